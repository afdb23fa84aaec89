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

Memory per rank in float32 with Adam, for Psi parameters (4 bytes of parameter, 4 of gradient and
8 of moments for each): plain data parallelism 16 Psi; stage 1: 8 Psi + 8 Psi / N; stage 2:
4 Psi + 12 Psi / N; stage 3: 16 Psi / N plus the layers gathered at once (the one computing and the
one being prefetched: 2 x 4 bytes x the largest layer). Psi counts the padding. Stages 2 and 3 also
hold a layer's whole gradients for the moment between its backward and its reduce-scatter.

Communication per step, for G = 4 Psi bytes of parameters: stages 1 and 2 reduce-scatter G and
all-gather G, one of each per layer: what an allreduce moves (a ring allreduce is a reduce-scatter
then an all-gather, 2(N-1)/N x G in and out of each rank). Stage 3 all-gathers twice (forward and
backward) and reduce-scatters once: 3 G counted, 3(N-1)/N x G per rank, 1.5 times an allreduce.

The network: the GPT of tensor_parallel.py with one change: no key bias. q.b_k adds the same
number to every score of a query, which the softmax ignores, so its gradient is zero in exact
arithmetic and it stays at its initial zero; in float32 that gradient is rounding noise, which
Adam, dividing each gradient by its own size, turns into full steps in random directions: summing
the gradients of 4 slices instead of one batch moved the key bias by 8e-6 in 30 steps and 6e-4 in
100, while every other parameter moved by less than 1e-6. Without it the check can be tight.

When to choose it: the model trains with data parallelism, but its parameters, gradients and
optimizer state do not fit on one device. Stages 1 and 2 cost nothing in traffic, so take them
first; stage 3 pays 1.5 times the traffic for memory that falls as 1/N.

The text: the standard library's argparse.py, textwrap.py and shlex.py, read from the running
Python, bytes >= 128 replaced by '?'.

Run:  mpirun -np 4 python sharded_data_parallel.py --zero-stage 3      (add --help for the flags)
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

import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

STRATEGY = "sharded_data_parallel"
TOLERANCE = 2e-5  # largest |difference| allowed against single-process training (float32)
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
VOCAB = 128  # the ASCII codes
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-6, 0.01  # AdamW's, as in BERT; EPS: see check()


# -----------------------------------------------------------------------------
# ZeRO: one layer's parameters as a flat vector, each rank owning a partition of it
# -----------------------------------------------------------------------------
class FlatLayer:
    """A layer's parameters as one flat vector, padded to a multiple of N. Rank r's partition is
    elements [r S, (r + 1) S), S = padded / N. The module's parameters become views into
    `whole`, so an all-gather into `whole` updates them; stage 3 frees `whole` between uses."""

    def __init__(self, module, comm, stage, device):
        self.module, self.params = module, list(module.parameters())
        world_size, rank = comm.Get_size(), comm.Get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // world_size) * world_size
        self.size = self.padded // world_size
        self.whole = torch.zeros(self.padded, device=device)
        offset = 0
        for p in self.params:
            self.whole[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.whole[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        mine = self.whole[rank * self.size:(rank + 1) * self.size]
        # The partition the optimizer updates: in stages 1 and 2 a view into the whole vector
        # (the all-gather after the step then runs in place), in stage 3 all that is kept.
        self.partition = mine.clone() if stage == 3 else mine
        if stage == 1:  # whole gradients, accumulated by autograd straight into one flat buffer
            self.grad_whole = torch.zeros(self.padded, device=device)
            offset = 0
            for p in self.params:
                p.grad = self.grad_whole[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            # Reduce_scatter_block in place leaves this rank's sum in the first S elements.
            self.partition.grad = self.grad_whole[:self.size]
        else:  # stages 2 and 3 keep only their partition of the gradients
            self.partition.grad = torch.zeros(self.size, device=device)
        self.request, self.gathered = None, True
        if stage == 3:
            self.free()

    def flat_grad(self):
        """This layer's whole gradient as one padded vector; the parameters' .grad are let go."""
        flat = torch.cat([p.grad.reshape(-1) for p in self.params]
                         + [self.whole.new_zeros(self.padded - self.numel)])
        for p in self.params:
            p.grad = None
        return flat

    def free(self):
        """Give the whole vector's memory back; the views (and autograd's saved tensors, which
        are views too) keep their shapes and see the values again after the next gather."""
        self.whole.untyped_storage().resize_(0)
        self.gathered = False


class ZeRO:
    """AdamW on this rank's partitions, and the exchange of ZeRO stage 1, 2 or 3 around it.

    Stage 1: backward fills whole gradients; then per layer a Reduce_scatter_block leaves each
    rank the sum of its partition, AdamW steps it, and an Allgather brings back every partition.
    Stage 2: a post-accumulate-grad hook counts each layer's gradients; when the layer's last one
    is in, its Ireduce_scatter_block starts while backward carries on with earlier layers.
    Stage 3: forward hooks all-gather a layer before its forward (starting the next one's gather
    as well) and free it after; a hook on its output gathers it again before its backward.
    """

    def __init__(self, model, comm, stage, lr, device):
        self.comm, self.stage, self.world_size = comm, stage, comm.Get_size()
        self.layers = [FlatLayer(m, comm, stage, device) for m in model.layers]
        self.optimizer = torch.optim.AdamW([layer.partition for layer in self.layers], lr=lr,
                                           betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        self.pending, self.arrived = [], [0] * len(self.layers)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # stage 3: whole layers held at once
        if stage >= 2:
            for i, layer in enumerate(self.layers):
                for p in layer.params:
                    p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        if stage == 3:
            for i, layer in enumerate(self.layers):
                layer.module.register_forward_pre_hook(lambda m, args, i=i: self._before_forward(i))
                layer.module.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i, out))

    # --- stage 3: gather a layer just before it is needed, free it right after ---------------
    def gather(self, i):
        """Start the all-gather of layer i's parameters into its whole vector, once."""
        layer = self.layers[i]
        if layer.gathered or layer.request is not None:
            return
        layer.whole.untyped_storage().resize_(layer.padded * layer.whole.element_size())
        layer.request = self.comm.Iallgather(layer.partition.detach(), layer.whole)
        self.gathered_bytes += layer.padded * layer.whole.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def wait_gathered(self, i):
        layer = self.layers[i]
        self.gather(i)
        if layer.request is not None:
            layer.request.Wait()
            layer.request, layer.gathered = None, True

    def release(self, i):
        layer = self.layers[i]
        layer.free()
        self.gathered_bytes -= layer.padded * layer.whole.element_size()

    def _before_forward(self, i):
        self.wait_gathered(i)
        if i + 1 < len(self.layers):
            self.gather(i + 1)  # prefetch: the next layer arrives while this one computes
        self.progress()

    def _after_forward(self, i, out):
        self.release(i)
        if out.requires_grad:  # the hook runs when out's gradient is in, before layer i's backward
            out.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i):
        self.wait_gathered(i)
        if i > 0:
            self.gather(i - 1)  # prefetch, backward runs the layers in reverse
        self.progress()

    # --- stages 2 and 3: reduce-scatter each layer's gradients as soon as backward has them --
    def _grad_ready(self, i):
        self.arrived[i] += 1
        layer = self.layers[i]
        if self.arrived[i] == len(layer.params):
            flat = layer.flat_grad()
            self.pending.append((flat, self.comm.Ireduce_scatter_block(flat, layer.partition.grad,
                                                                       op=MPI.SUM)))
            if self.stage == 3:
                self.release(i)  # its backward is over: every node that used it has run
        self.progress()

    def progress(self):
        """MPICH moves a non-blocking collective forward only inside MPI calls: poll them all."""
        for _, request in self.pending:
            request.Test()
        for layer in self.layers:
            if layer.request is not None:
                layer.request.Test()

    # --- one optimizer step -------------------------------------------------------------------
    def zero_grad(self):
        self.arrived = [0] * len(self.layers)
        for layer in self.layers:
            if self.stage == 1:
                layer.grad_whole.zero_()  # autograd adds into it

    def backward(self, loss):
        """loss.backward() with the gradient exchange; leaves each partition's mean gradient."""
        loss.backward()
        if self.stage == 1:
            for layer in reversed(self.layers):
                self.comm.Reduce_scatter_block(MPI.IN_PLACE, layer.grad_whole, op=MPI.SUM)
        else:
            assert all(n == len(layer.params) for n, layer in zip(self.arrived, self.layers)), \
                "a gradient never arrived"
            for _, request in self.pending:
                request.Wait()
            self.pending = []
        for layer in self.layers:
            layer.partition.grad /= self.world_size  # each rank's loss is the mean of its slice

    def step(self):
        """AdamW on this rank's partitions; stages 1 and 2 then all-gather the parameters."""
        self.optimizer.step()
        if self.stage < 3:
            for layer in self.layers:
                self.comm.Allgather(MPI.IN_PLACE, layer.whole)


def memory_per_rank(zero):
    """Bytes of parameters, gradients and optimizer state this rank holds, measured from the
    tensors themselves (each storage once, padding included), and stage 3's peak of gathered
    whole layers."""
    def held(tensors):
        storages = {}
        for t in tensors:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(n for ptr, n in storages.items() if ptr)

    params = [p for layer in zero.layers for p in layer.params + [layer.partition]]
    grads = [t.grad for t in params]
    state = [v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    measured = {"parameters": held(params), "gradients": held(grads), "optimizer": held(state),
                "gathered": zero.peak_gathered_bytes}
    measured["total"] = sum(measured.values())
    return measured


def memory_formula(zero):
    """The paper's bytes per rank for this stage, with Psi counting the padding."""
    psi, n = sum(layer.padded for layer in zero.layers), zero.world_size
    sizes = [layer.padded for layer in zero.layers]
    neighbours = max(a + b for a, b in zip(sizes, sizes[1:]))  # the layer at work and the next
    formula = {"parameters": 4 * psi if zero.stage < 3 else 4 * psi // n,
               "gradients": 4 * psi if zero.stage == 1 else 4 * psi // n,
               "optimizer": 8 * psi // n,
               "gathered": 4 * neighbours if zero.stage == 3 else 0}
    formula["total"] = sum(formula.values())
    return formula


def whole_parameters(zero, model):
    """{name: whole tensor} of every parameter, on every rank (stage 3 all-gathers them)."""
    full = {}
    for layer in zero.layers:
        whole = layer.whole
        if zero.stage == 3:
            whole = torch.empty(layer.padded, device=layer.partition.device)
            zero.comm.Allgather(layer.partition, whole)
        offset = 0
        for p in layer.params:
            full[p] = whole[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    return {name: full[p] for name, p in model.named_parameters()}


# -----------------------------------------------------------------------------
# Model: the GPT of tensor_parallel.py as a list of layers, without the key bias
# -----------------------------------------------------------------------------
def attend(q, k, v, heads):
    """Causal self-attention of `heads` heads."""
    b, t, c = q.shape
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // heads)
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2).reshape(b, t, c)


class Embedding(nn.Module):
    def __init__(self, hidden, seq_len):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, hidden), nn.Embedding(seq_len, hidden)

    def forward(self, idx):
        return self.tokens(idx) + self.positions(torch.arange(idx.size(1), device=idx.device))


class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so float32 rounding differences between world sizes stay at rounding level."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.q = nn.LayerNorm(hidden), nn.Linear(hidden, hidden)
        self.k, self.v = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2, self.fc1 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        a = self.ln1(x)
        x = x + self.proj(attend(self.q(a), self.k(a), self.v(a), self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm, self.out = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


class GPT(nn.Module):
    """Embeddings, --layers blocks, final LayerNorm and untied head: the layers ZeRO flattens."""

    def __init__(self, layers, hidden, heads, seq_len):
        super().__init__()
        self.layers = nn.ModuleList([Embedding(hidden, seq_len)]
                                    + [Block(hidden, heads) for _ in range(layers)] + [Head(hidden)])

    def forward(self, idx):
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(args):
    """The full model from the seed, on the CPU: the same network at every world size."""
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.hidden, args.heads, args.seq_len)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    return model


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
# The run: each rank its slice of the batch, ZeRO around backward and the step
# -----------------------------------------------------------------------------
def train_step(model, zero, x, y, timeline):
    zero.zero_grad()
    with timeline.span("compute", "forward"):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    with timeline.span("compute", "backward"):
        zero.backward(loss)
    with timeline.span("compute", "optimizer"):
        zero.step()
    return loss.item()


def setup(args, comm, device):
    """The full model from the seed on every rank's CPU; ZeRO keeps what this stage keeps."""
    model = build_model(args)
    param_count = sum(p.numel() for p in model.parameters())
    return model, ZeRO(model, comm, args.zero_stage, args.lr, device), param_count


def train(args, comm, device, model, zero, done=(), config=None, log=False):
    """The steps after the `done` ones (their global losses, from a checkpoint); returns the
    global losses of all steps and this rank's timings of the new ones."""
    rank, world_size, timeline = comm.Get_rank(), comm.Get_size(), comm.timeline
    losses, records, per_rank = list(done), [], args.batch_size // world_size
    for step in range(len(done), args.steps):
        inject_failure(comm, step)
        start = time.perf_counter()
        x, y = make_batch(args.seed, step, args.batch_size, args.seq_len)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = train_step(model, zero, x.to(device), y.to(device), timeline)
        losses.append(comm.allreduce(loss) / world_size)  # a float: reporting, not counted
        sync(device)
        record = {"step_s": time.perf_counter() - start, **{f"{k}_s": v for k, v in timeline.take().items()}}
        record["idle_s"] = max(0.0, record["step_s"] - record.get("compute_s", 0) - record.get("comm_s", 0))
        records.append(record)
        if log and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            say(comm, f"step {step + 1}/{args.steps} | loss {losses[-1]:.4f} | "
                      f"{record['step_s'] * 1e3:.1f} ms/step | comm {record.get('comm_s', 0) * 1e3:.1f} ms | "
                      f"idle {100 * record['idle_s'] / record['step_s']:.0f}%")
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            save_checkpoint(comm, args.save, step + 1, zero_shard(zero, losses), config)
    return losses, records


def main(argv=None, comm=MPI.COMM_WORLD):
    try:
        args = parse_args(argv, comm.Get_size())
    except ConfigError as e:
        return refuse(comm, e)
    comm.Barrier()
    t0 = time.perf_counter()  # the trace's zero, about the same moment on every rank
    device = setup_device(comm, args.device)
    counted = CountedComm(comm, Timeline(device))
    model, zero, param_count = setup(args, counted, device)
    config = {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
              "seq_len": args.seq_len, "vocab": VOCAB}
    done = []
    if args.resume:
        try:
            manifest, done = resume(comm, args, config, zero)
        except ConfigError as e:
            return refuse(comm, e)
        say(comm, f"resumed from {args.save} at step {manifest['step']} "
                  f"(written by {manifest['world_size']} ranks)")
    report_header(comm, args, device, zero, param_count)
    losses, records = train(args, counted, device, model, zero, done, config, log=True)
    ran = max(1, args.steps - len(done))  # per-step counts: the training exchanges only
    calls = {k: v / ran for k, v in counted.calls.items()}
    volume = {k: v / ran for k, v in counted.bytes.items()}
    every = comm.allgather(memory_per_rank(zero))  # the same on every rank: S is too
    memory = {k: max(m[k] for m in every) for k in every[0]}
    diff = None
    if args.check:
        full = whole_parameters(zero, model)
        diff = check(args, losses, full) if comm.Get_rank() == 0 else None
        diff = comm.bcast(diff, root=0)
    if args.trace:
        write_trace(comm, counted.timeline, args.trace, t0)
    return report(comm, args, device, zero, param_count, losses, records, calls, volume, memory, diff)


def report_header(comm, args, device, zero, param_count):
    padded = sum(layer.padded for layer in zero.layers)
    say(comm, f"{STRATEGY} | {comm.Get_size()} ranks | device {device.type} | {mpi_library()}",
        f"ZeRO stage {args.zero_stage} | model: GPT, {args.layers} blocks, hidden {args.hidden}, "
        f"{args.heads} heads, {param_count:,} parameters in {len(zero.layers)} layers, padded to "
        f"{padded:,} (each layer a multiple of {comm.Get_size()}); this rank owns "
        f"{sum(layer.size for layer in zero.layers):,}",
        f"global batch {args.batch_size} x {args.seq_len} characters = {comm.Get_size()} ranks x "
        f"{args.batch_size // comm.Get_size()} | AdamW, lr {args.lr:g}, weight decay {WEIGHT_DECAY:g}")


def report(comm, args, device, zero, param_count, losses, records, calls, volume, memory, diff):
    """The summary on rank 0, and --json's object; returns the exit status."""
    world_size, stage = comm.Get_size(), args.zero_stage
    slowest, _ = step_summary(comm, records)
    padded = sum(layer.padded for layer in zero.layers)
    formula_bytes = (2 if stage < 3 else 3) * 4 * padded
    formula = memory_formula(zero)
    say(comm, f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}; a uniform guess is "
              f"ln {VOCAB} = {math.log(VOCAB):.4f})",
        f"median step {slowest['step_s'] * 1e3:.1f} ms: compute {slowest['compute_s'] * 1e3:.1f} | "
        f"comm {slowest['comm_s'] * 1e3:.1f} | idle {slowest['idle_s'] * 1e3:.1f} ms (slowest rank)",
        f"per step: " + ", ".join(f"{calls[k]:g} {k} ({volume[k]:,.0f} bytes)" for k in sorted(calls))
        + f"; total {sum(volume.values()):,.0f} bytes; formula {'2' if stage < 3 else '3'} x 4 Psi = "
        f"{formula_bytes:,} (Psi = {padded:,} with padding), "
        + ("what an allreduce of the gradients moves" if stage < 3 else "1.5 x an allreduce")
        + f"; a ring moves (N-1)/N of it in and out of each rank = "
          f"{(world_size - 1) / world_size * formula_bytes:,.0f}",
        f"memory per rank, measured (formula): "
        + " | ".join(f"{k} {memory[k]:,} ({formula[k]:,})" for k in formula)
        + f"; plain data parallelism: 16 Psi = {16 * padded:,}")
    if device.type == "cuda":
        say(comm, f"CUDA peak allocated on rank 0: {torch.cuda.max_memory_allocated(device):,} bytes")
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
            "check_max_abs_diff": diff, "zero_stage": stage, "param_count": param_count,
            "padded_param_count": padded, "memory_bytes_per_rank": memory,
            "memory_bytes_formula": formula, "comm_bytes_formula": formula_bytes,
            "collectives_by_kind": calls}))
    return 0 if ok else 1


# =============================================================================
# You may stop reading here: below is the machinery every strategy file repeats
# (the check, the report, checkpoints, counters, device and MPI setup, arguments).
# =============================================================================

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
    p = Parser(description="Sharded data parallelism over MPI (ZeRO 1, 2, 3): a small GPT on Python's own source.")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16,
                   help="global batch: samples per optimizer step, whatever the world size")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (AdamW)")
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
    # ZeRO's own flag.
    p.add_argument("--zero-stage", type=int, default=3, choices=(1, 2, 3),
                   help="1: optimizer state sharded; 2: and gradients; 3: and parameters")
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
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads of equal "
                          f"size; use a multiple of {args.heads}, e.g. {16 * args.heads}")
    if args.batch_size % world_size:
        works = [b for b in range(world_size, 4 * world_size + 1, world_size)]
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {world_size} ranks; "
                          f"use a multiple of {world_size}, e.g. {', '.join(map(str, works[:3]))}")
    if args.seq_len >= len(load_text()):
        raise ConfigError(f"--seq-len {args.seq_len} must be shorter than the text ({len(load_text())})")
    return args


def refuse(comm, error):
    if comm.Get_rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    return 2


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
# Communication: a timeline of spans, and a communicator that counts what passes through it
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


class CountedComm:
    """An MPI communicator, passed through: each collective on tensors is counted (calls, and
    bytes of its larger buffer: the whole vector) and timed as a 'comm' span, and so is waiting
    for a non-blocking one. Everything else goes to the communicator unchanged."""

    COUNTED = ("Allreduce", "Reduce_scatter_block", "Ireduce_scatter_block", "Allgather", "Iallgather")

    def __init__(self, comm, timeline):
        self.comm, self.timeline = comm, timeline
        self.calls, self.bytes = collections.Counter(), collections.Counter()

    def __getattr__(self, name):
        method = getattr(self.comm, name)
        if name not in self.COUNTED:
            return method

        def counted(sendbuf, recvbuf, *args, **kwargs):
            self.calls[name] += 1
            self.bytes[name] += max(t.numel() * t.element_size() for t in (sendbuf, recvbuf)
                                    if torch.is_tensor(t))
            with self.timeline.span("comm", name):
                result = method(sendbuf, recvbuf, *args, **kwargs)
            return TimedRequest(result, self.timeline, name) if isinstance(result, MPI.Request) else result
        return counted


class TimedRequest:
    def __init__(self, request, timeline, name):
        self.request, self.timeline, self.name = request, timeline, name

    def Test(self):
        return self.request.Test()

    def Wait(self):
        with self.timeline.span("comm", self.name + " wait"):
            return self.request.Wait()


# -----------------------------------------------------------------------------
# Checkpoints: a folder appears whole or not at all; ZeRO's shards re-cut for any world size
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


def zero_shard(zero, losses):
    """What each rank saves: its partition of every layer's parameters and Adam moments (copies:
    a view would save the whole vector), each layer's unpadded size, and the losses so far."""
    layers = []
    for layer in zero.layers:
        state = zero.optimizer.state[layer.partition]
        layers.append({"params": layer.partition.detach().cpu().clone(), "numel": layer.numel,
                       "exp_avg": state["exp_avg"].cpu().clone(),
                       "exp_avg_sq": state["exp_avg_sq"].cpu().clone()})
    step = zero.optimizer.state[zero.layers[0].partition]["step"].item()
    return {"layers": layers, "adam_step": step, "losses": list(losses)}


def resume(comm, args, config, zero):
    """Read every rank's shard of the latest checkpoint, whatever the world size that wrote it,
    and re-cut them for this one. Returns the manifest and the losses so far."""
    manifest, first = load_checkpoint(comm, args.save, config, lambda m: "rank-0.pt", args.steps,
                                      same_world_size=False)
    shards = [first] + [load_checkpoint(comm, args.save, config, lambda m, r=r: f"rank-{r}.pt",
                                        args.steps, same_world_size=False)[1]
                        for r in range(1, manifest["world_size"])]
    rank = comm.Get_rank()
    for i, layer in enumerate(zero.layers):
        def recut(key):
            """Layer i's whole vector from every saved partition, padded for this world size;
            this rank's partition of it."""
            whole = torch.cat([s["layers"][i][key] for s in shards])[:layer.numel]
            whole = torch.cat([whole, whole.new_zeros(layer.padded - layer.numel)])
            return whole.to(layer.partition.device), whole[rank * layer.size:(rank + 1) * layer.size]
        with torch.no_grad():
            whole, mine = recut("params")
            layer.partition.copy_(mine)
            if zero.stage < 3:
                layer.whole.copy_(whole)
        zero.optimizer.state[layer.partition] = {
            "step": torch.tensor(float(shards[0]["adam_step"])),
            "exp_avg": recut("exp_avg")[1].clone().to(layer.partition.device),
            "exp_avg_sq": recut("exp_avg_sq")[1].clone().to(layer.partition.device)}
    return manifest, shards[0]["losses"]


# -----------------------------------------------------------------------------
# Check against single-process training
# -----------------------------------------------------------------------------
def reference_training(args):
    """The same steps in one plain process on the CPU: the plain model, AdamW, the whole batch."""
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
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
    """Largest |difference| in losses and in final parameters (full: the whole parameters).
    Only float32 sums are reordered (each rank's gradient is that of its slice, then summed), but
    Adam divides each gradient by its own size, which amplifies rounding: summing 4 slices instead
    of one batch in one process moved the parameters by 5e-7 after 50 steps and 2.4e-6 after 100
    at the default sizes and lr 1e-3 (at lr 3e-3, 2e-2 after 50: a loss spike at step 35 turned
    rounding into chaos); with eps 1e-8 one weight of 200k moved by 5e-5 in the first step (a
    step changes by up to lr x delta / eps for a change delta of its gradient), hence EPS 1e-6.
    TOLERANCE is 2e-5."""
    ref_losses, ref_model = reference_training(args)
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for name, p in ref_model.named_parameters():
        diff = max(diff, (full[name].double().cpu() - p.detach().double()).abs().max().item())
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


def abort_on_exception(kind, value, tb):
    """An exception on one rank must end the whole job, not leave the others in a collective."""
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(kind, value, tb))
    print(f"rank {rank}: {text}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    sys.excepthook = abort_on_exception
    sys.exit(main())
