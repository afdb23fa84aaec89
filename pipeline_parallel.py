"""Pipeline parallelism over MPI: the layer stack is cut into stages, the batch into micro-batches.

What is split: the model's layers. Rank r holds one contiguous stage of the stack (or V chunks of
it), with its parameters and their optimizer state. The global batch of B sequences is cut into M
micro-batches (--micro-batches) that flow through the stages one after another, so that several
ranks compute at once, each on a different micro-batch.

   tokens  +------------+ act  +---------+ act  +---------+ act  +--------------+  loss
   ------> | rank 0     | ---> | rank 1  | ---> | rank 2  | ---> | rank 3       | ----->
           | embeddings | <--- | blocks  | <--- | blocks  | <--- | blocks, norm |
           | blocks     | grad |         | grad |         | grad | head, loss   |
           +------------+      +---------+      +---------+      +--------------+

Schedules, as the dry run draws them for N = 3 ranks, M = 3 micro-batches (F: forward, one slot;
B: backward, two slots, or split into B, the input's gradient the previous stage waits for, and W,
the weights' gradients nobody waits for, one slot each; '.' idle):

   --schedule 1f1b (PipeDream-Flush, Narayanan et al. 2021); gpipe (Huang et al. 2019) runs all
   forwards first, for the same bubble and M micro-batches held instead of min(M, N - r)
   rank 0 | F0 F1 F2 .  .  .  .  B0 B0 .  B1 B1 .  B2 B2
   rank 1 | .  F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2 .  .
   rank 2 | .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .  .  .
   --schedule zb-h1 (zero bubble, Qi et al. 2023): rank r keeps its first r W for the cool-down
   rank 0 | F0 F1 F2 .  .  B0 W0 B1 W1 B2 W2
   rank 1 | .  F0 F1 .  B0 F2 B1 W0 B2 W1 W2
   rank 2 | .  .  F0 B0 F1 B1 F2 B2 W0 W1 W2
   --schedule zbv: two chunks a, b per rank in a V, down the ranks and back up to rank 0's loss;
   at M = 3 < 2N-1 the greedy lists of zbv_orders (the paper's handcrafted lists need M >= 2N-1)
   rank 0 | F0a F1a F2a .   .   F0b B0b F1b B1b F2b B2b B0a W0a B1a W0b B2a W1a W1b W2a W2b
   rank 1 | .   F0a F1a F2a F0b .   F1b B0b F2b B1b B0a B2b B1a W0a B2a W0b W1a W1b W2a W2b
   rank 2 | .   .   F0a F0b F1a F1b F2a F2b B0b B0a B1b B1a B2b B2a W0a W0b W1a W1b W2a W2b
   --schedule interleaved --virtual-stages V (Megatron): rank r holds chunks r, r+N, ... and runs
   the micro-batches in groups of N through each (M a multiple of N)

The bubble (idle share of the step, equal costs): (N-1)/(M+N-1) for gpipe and 1f1b, (N-1)/(VM+N-1)
interleaved, 1 - 3M/(2M+N-1+max(M,N)) for zb-h1 (at M >= N a third of 1f1b's idle time) and
(N-1)/(6M+N-1) for zbv at M >= N, the least possible (its last rank waits for N-1 half stages).
With zbv's handcrafted lists (M >= 2N-1) no rank idles between its first and last action: steps back
to back leave no bubble, the paper's zero; 1f1b and zb-h1 keep theirs (rank 0 idles inside). Here
the gradient norm's allreduce ends each step, a wait the paper removes too (it validates after the
step). Peak memory, in micro-batches held from F to B (or W): zb-h1 min(M, N), zbv min(2M, 2N) half
stages: no more than 1f1b's on rank 0; interleaved up to (N-1)/V stages more. A dry run executes
every rank's actions on paper before anything is sent: every send meets its receive, every input
exists before use, no deadlock. Each micro-batch's loss: over the step's valid targets.

Activations: bytes a micro-batch of b = B/M sequences keeps from F to B per block (s = T, h = H, a
heads, e = 4 fp32, 2 bf16; Korthikanti et al. 2022), and what --recompute leaves of them:
   none       bs(8h + 14eh + 16) + abs^2 x (4, or 6 in bf16: softmax's float32 output + bf16 copy)
   selective  bs(8h + 14eh + 16), that is bs(64h + 16) in fp32, bs(36h + 16) in bf16
   full       4bsh, the block's input (the residual stream is float32 in both)
plus 8bs + 8s on the first stage (tokens, positions), bs((4+e)h + 4V + 16) + 4 on the last (head,
log-softmax, targets); from B to W, each Linear's input and output gradient, 16ebsh a block (+
ebs(h+V) on the last stage), which no recomputation removes. The dry run's bound (micro-batches
held) stays: a rank holds at most bound x a micro-batch's bytes (zero bubble: F-to-B's or B-to-W's).
Recomputation: torch.utils.checkpoint(fn, *inputs, use_reentrant=True), fn a block (full) or
attention's scores, mask, softmax and x V (selective: q, k, v kept). The reentrant form keeps fn's
inputs by save_for_backward, where the saved-tensor hooks that count activations see them (the other
form hides them), runs fn without autograd and reruns it in backward under the forward's autocast.
It refuses backward(inputs=): B is a plain backward that the Linears split (W gets their weights').

Precision: --precision bf16 runs forward and loss under torch.autocast(bfloat16) on float32
parameters, the master weights: autocast casts each to bf16 as a matmul uses it (autograd keeps the
copy); gradients land in float32 on the parameters, where the micro-batches add up (bf16 would halve
their memory but round away small contributions; none crosses a rank), SGD's momentum is float32.
Softmax, LayerNorm statistics, the loss and the residual stream stay float32. A message casts the
residual to bf16 (back up on arrival) and its gradient too: half the bytes, for one rounding more,
as autocast rounds every matmul input (Megatron sends bf16). MPI, which has no bf16 arithmetic, only
moves buffers here: each is bf16 in bf16 runs, float32 in fp32.

Communication per step: each of the K stage boundaries between ranks (N-1; NV-1 interleaved; 2N-2
in a V) carries M activations forward and M gradients back, each (B/M) x T x H elements of e bytes:
2K x B x T x H x e bytes in 2MK point-to-point messages, and the gradient norm's 4-byte allreduce.

When to choose it: the model does not fit on one device and the links between devices are slow
(only activations cross, and only at stage boundaries), with enough micro-batches per batch to
keep the bubble small. Combine it with data parallelism for more samples per second.

The network: a GPT-2 style character-level language model trained on the source of Python's own
argparse.py, textwrap.py and shlex.py. Run:  mpirun -np 4 python pipeline_parallel.py  (--help)
"""
import argparse, collections, contextlib, ctypes, errno, functools, hashlib, importlib.util, io, json  # noqa: E401
import math, os, pickle, shutil, signal, statistics, sys, time, traceback, types, weakref  # noqa: E401

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import mpi4py

mpi4py.rc.initialize = False  # MPI starts in start_mpi(), once this rank's GPU is chosen
mpi4py.rc.finalize = True  # and ends when the process does
from mpi4py import MPI  # noqa: E402

STRATEGY = "pipeline_parallel"
# Largest |difference| allowed against single-process training (float32). Micro-batches change
# the order of the float32 sums; over the default 60 steps that left at most 2.4e-6 in losses and
# parameters (M = 2, 8, 16, both schedules, seeds 0-2): an eightfold margin.
TOLERANCE = 2e-5
# bf16, both sides alike (autocast, same micro-batches, stream rounded at boundaries), 60 default
# steps: SGD, any schedule, N = 1-4, 2.9e-6 at most; the recipe (AdamW 1e-3, clip 1, cosine) 5.9e-3
# to 9.6e-3 on AVX-512 BF16 (fp32 1.9e-6): AdamW's bf16 steps part, not the stages. Gradients / N: 1.2e-1.
TOLERANCE_BF16 = 2e-2
SOURCES = ("argparse", "textwrap", "shlex")  # standard library modules whose source is the text
VOCAB, IGNORE = 128, -100  # ASCII codes; F.cross_entropy's ignore_index, past a document's end
POLL_S = 1e-4  # a rank waiting on MPI sleeps between polls, leaving the core to ranks that compute


# -----------------------------------------------------------------------------
# The strategy: each rank executes its list of actions; the schedules make the lists
# -----------------------------------------------------------------------------
# The model is cut into S = N x V stages (V chunks per rank; V = 1 but for interleaved and zbv).
# An Action is op on micro-batch mb of `stage`: a computation, forward, backward (input and weights
# at once), backward_input (B: the gradient the previous stage waits for) or backward_weight (W: the
# weights' gradients, which nobody waits for), or a message: send_/recv_act, the input of `stage`,
# from stage - 1; send_/recv_grad, its gradient, from stage + 1. COST: a computation's slots.
Action = collections.namedtuple("Action", "op mb stage")
COST = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}


def train_step(stage, optimizer, actions, ranks, x, y, m, comm, meter, timeline, precision="fp32",
               max_norm=0.0, norm_comm=None):
    """One optimizer step: this rank's actions over M micro-batches. stage[c] is this rank's c-th
    chunk, ranks[s] the rank of stage s. The gradients clipped to the global norm max_norm (0: not).
    Returns the step's loss on the rank of the last stage (the sum of the micro-batches' losses,
    each over the step's count of valid targets), elsewhere 0; and the norm, before the clip."""
    rank, last, bf16 = comm.Get_rank(), len(ranks) - 1, precision == "bf16"
    # Every rank makes the whole batch from (seed, step): the last stage counts the valid targets of
    # all M micro-batches itself, before the first forward, and needs no message for it.
    valid = int((y != IGNORE).sum())  # a number: each loss would save a tensor divisor for backward
    wire = torch.bfloat16 if bf16 else torch.float32  # what crosses a stage boundary, both ways
    chunk = {s: stage[c] for c, s in enumerate(s for s in range(last + 1) if ranks[s] == rank)}
    # Each micro-batch's tokens and targets in storage of their own: the meter counts what the
    # embeddings and the loss keep for backward, not the whole batch that a view would share.
    xs, ys = ([c.clone() for c in t.chunk(m)] for t in (x, y))
    inputs, outputs, arrived, later, recvs, sends, total = {}, {}, {}, {}, {}, [], 0.0
    optimizer.zero_grad(set_to_none=False)

    def peer(a):  # an input comes from the stage before and goes to the one after, a gradient back
        return ranks[a.stage + (1 if a.op in ("send_act", "recv_grad") else -1)]

    def post(a):  # start receiving: the message lands while this rank computes
        t = torch.empty(x.size(0) // m, x.size(1), stage.hidden, dtype=wire, device=x.device)
        buffer = mpi_buffer(t, send=False)
        recvs[a] = (t, buffer, comm.Irecv(buffer, peer(a), tag(a.op[5:], a.mb, a.stage, last + 1)))

    for k, a in enumerate(actions):
        key, kind = (a.stage, a.mb), a.op[5:]  # kind: "act" or "grad" for a message (recv_act...)
        if a.op in COST:  # post the next receive from another rank before computing
            upcoming = next((b for b in actions[k + 1:]
                             if b.op.startswith("recv_") and peer(b) != rank), None)
            if upcoming is not None and upcoming not in recvs:
                post(upcoming)
        if a.op.startswith("recv_") and peer(a) != rank:  # from this rank: already in `arrived`
            if a not in recvs:
                post(a)
            t, buffer, request = recvs.pop(a)
            request.Wait()  # idle until the peer's message is in
            arrived[kind, key] = from_mpi(t, buffer)
        elif a.op.startswith("send_"):
            to = a.stage + 1 if kind == "act" else a.stage - 1
            t = (outputs[key].detach().to(wire) if kind == "act"
                 else inputs.pop(key).grad)  # a grad: wire's too
            if peer(a) == rank:  # the next stage lives here too (the turn of the V): no message
                arrived[kind, (to, a.mb)] = t
            else:  # the buffer must stay untouched until the send completes
                buffer = mpi_buffer(t.contiguous())
                sends.append((buffer, comm.Isend(buffer, peer(a), tag(kind, a.mb, to, last + 1))))
        elif a.op == "forward":
            with timeline.span("compute", f"F{a.mb}"), meter.saving(key), \
                    torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
                inp = xs[a.mb] if a.stage == 0 else arrived.pop(("act", key)).requires_grad_()
                h = inp.float() if a.stage else inp  # the residual stream goes on in float32
                out = chunk[a.stage](h) if len(chunk[a.stage]) else h.view_as(h)  # empty: pass on
                if a.stage == last:  # float32 / the step's count: the gradients sum to the batch's
                    out = micro_batch_loss(out, ys[a.mb], valid)
                    total += out.item()
            inputs[key], outputs[key] = inp, out
        elif a.op in ("backward", "backward_input"):
            grad = None if a.stage == last else arrived.pop(("grad", key)).float()  # as its output
            with timeline.span("compute", f"{a.op[0].upper()}{a.mb}"):
                outputs.pop(key).backward(grad)
                if a.op == "backward_input":  # B: the input's gradient and the small weights'
                    # (LayerNorm, embeddings). Each Linear's backward (LinearWeightsLater, below)
                    # gave none for its weights but left in chunk.later what W needs: held until W
                    later[key] = [(meter.hold(key, x_), meter.hold(key, g), w, b)
                                  for x_, g, w, b in chunk[a.stage].later]
                    chunk[a.stage].later.clear()
            if a.stage == 0:
                inputs.pop(key)
        elif a.op == "backward_weight":
            with timeline.span("compute", f"W{a.mb}"):
                weight_gradients(later.pop(key))
        sends = [(b, s) for b, s in sends if not s.Test()]  # MPICH progresses only inside MPI calls
    for _, request in sends:
        request.Wait()
    norm = global_grad_norm(stage, norm_comm or comm)  # after every rank's last backward (or W)
    with timeline.span("compute", "optimizer"):
        scale = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s, the same on every rank
        for p in stage.parameters() if max_norm and scale < 1 else []:
            p.grad.mul_(scale)
        optimizer.step()
    return total, norm


def micro_batch_loss(logits, targets, valid):
    """A micro-batch's part of the step's loss: its cross-entropy summed over its valid targets,
    over the step's count of them. Over its own count, a micro-batch with fewer valid targets would
    weigh each more: a different gradient from one process's on the whole batch."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                           reduction="sum") / valid


def global_grad_norm(stage, comm):
    """The norm of the whole model's gradient in float32, each parameter counted once, the same on
    every rank. A parameter lives in one chunk of one rank (zbv's rank 0 holds the first stage and
    the last: two chunks, distinct parameters): each rank adds the squares of every chunk it holds,
    once, and one allreduce of that float32 over the pipeline's ranks adds the other stages'."""
    squares = torch.stack([p.grad.float().square().sum()
                           for p in stage.parameters()]).sum().reshape(1)
    buffer = mpi_buffer(squares)
    comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
    return from_mpi(squares, buffer).sqrt().item()


# MPI reads GPU memory only when the library is CUDA-aware (found at start-up by setup()).
# Otherwise a tensor on a GPU travels through a host copy. On the CPU these helpers do nothing.
CUDA_AWARE = False


def mpi_buffer(t, nonblocking=False, send=True):
    """The buffer to hand MPI for t: t itself, or a pinned host copy (for a receive, an empty one).
    Open MPI's non-blocking collectives never read GPU memory, CUDA-aware or not: always staged."""
    if not t.is_cuda:
        return t
    if CUDA_AWARE and not nonblocking:
        done = torch.cuda.Event()
        done.record()
        # t's queued kernels finish first: those writing it, or (a receive) reading its old memory
        done.synchronize()
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t) if send else host  # copy_ waits for t's kernels


def from_mpi(t, buffer):
    """Copy back what MPI wrote into a host copy (mpi_buffer's) to t; returns t."""
    if buffer is not t:
        t.copy_(buffer)
    return t


def tag(kind, mb, stage, stages):
    """The message that carries the input (act) or the gradient (grad) of `stage` for micro-batch
    mb: a tag of its own for each message of a step, so none can match another's receive."""
    return 1 + 2 * (mb * stages + stage) + (kind == "grad")


def check_tags(comm, m, stages):
    """The largest tag, 2 x M x S, must not exceed the library's MPI_TAG_UB (MPI promises 32767)."""
    largest, bound = tag("grad", m - 1, stages - 1, stages), comm.Get_attr(MPI.TAG_UB)
    if largest > bound:
        raise ConfigError(f"--micro-batches {m} through {stages} stages needs message tags up to "
                          f"{largest}, above this MPI's bound of {bound}: use --micro-batches "
                          f"{bound // (2 * stages)} or fewer")


class LinearWeightsLater(torch.autograd.Function):
    """F.linear whose backward gives only the input's gradient (B) and leaves the weights' (W),
    with the tensors they need, in a list: zero-bubble schedules run W where the pipeline idles."""

    @staticmethod
    def forward(ctx, x, weight, bias, later):
        if torch.is_autocast_enabled(x.device.type):  # the bf16 copy of x that autocast would keep
            x = x.to(torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.later = weight, bias, later  # for W: the float32 parameters as is
        return F.linear(x, weight, bias)  # autocast casts weight and bias to bf16 as it uses them

    @staticmethod
    def backward(ctx, grad):  # grad is bf16 under autocast: so is the weights' copy, cast anew
        ctx.later.append((ctx.saved_tensors[0], grad, ctx.weight, ctx.bias))
        return grad @ ctx.weight.to(grad.dtype), None, None, None


class Linear(nn.Linear):
    """nn.Linear; with `later` set to a list, its weights' gradients wait there for W."""
    later = None

    def forward(self, x):
        return super().forward(x) if self.later is None else \
            LinearWeightsLater.apply(x, self.weight, self.bias, self.later)


class ActivationMeter:
    """What autograd really holds for each (stage, micro-batch) between its forward and its backward
    (or W), in a run's first step (each step holds the same; its hooks cost Python time on every
    saved tensor, so later steps run without them, `on` False): every saved tensor counted by storage
    until the last reference to it dies (a weakref finalizer), parameters, buffers and autocast's
    bf16 copies of them left out. Peak: the most (stage, micro-batch) pairs at once, and their bytes."""

    def __init__(self, stage):
        self.fixed = {t.untyped_storage().data_ptr()
                      for t in [*stage.parameters(), *stage.buffers()]}
        self.parameters = {id(p) for p in stage.parameters()}
        # live: key -> bytes; refs: (key, storage) -> tensors
        self.live, self.refs, self.on = collections.Counter(), collections.Counter(), True
        self.peak_count = self.peak_bytes = self.per_mb = 0

    def hold(self, key, t):
        """Count t for key until the object returned (an alias of t) is freed."""
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if not self.on or ptr in self.fixed or self.parameter_copy(t):
            return t if self.on else t.detach()  # off: the alias, uncounted
        alias = t.detach()
        self.refs[key, ptr] += 1
        if self.refs[key, ptr] == 1:
            self.live[key] += size
            self.per_mb = max(self.per_mb, self.live[key])
            self.peak_count = max(self.peak_count, len(self.live))
            self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))
        weakref.finalize(alias, self.release, key, ptr, size)
        return alias

    def parameter_copy(self, t):
        """autocast's bf16 copy of a parameter (or a view of it): made by a cast (ToCopyBackward0)
        straight from the parameter's AccumulateGrad. A weight, not an activation."""
        cast = (t if t._base is None else t._base).grad_fn
        return type(cast).__name__ == "ToCopyBackward0" and \
            id(getattr(cast.next_functions[0][0], "variable", None)) in self.parameters

    def release(self, key, ptr, size):
        self.refs[key, ptr] -= 1
        if not self.refs[key, ptr]:
            del self.refs[key, ptr]
            self.live[key] -= size
            if not self.live[key]:
                del self.live[key]

    def saving(self, key):
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.hold, key), lambda t: t)
        return hooks if self.on else contextlib.nullcontext()


def weight_gradients(work):
    """W: the weights' gradients that the backward of Linear (B) left for later, added up."""
    for x, grad, weight, bias in work:
        g = grad.reshape(-1, grad.shape[-1])
        for p, value in ((weight, g.t() @ x.reshape(-1, x.shape[-1])), (bias, g.sum(0))):
            if p is not None:  # a bf16 product under autocast, added up in float32 on the parameter
                p.grad = value.to(p.dtype) if p.grad is None else p.grad.add_(value)


class ScheduleError(Exception):
    """A schedule that would deadlock, lose a message or use an input before it exists."""


def chunks_of(name, v):
    return {"interleaved": v, "zbv": 2}.get(name, 1)


def stage_rank(name, n, s):
    """The rank that holds stage s: round robin (chunks r, r+N, ...), or for zbv a V: down the
    ranks and back up, so that rank 0 holds the first and the last stage."""
    return (s if s < n else 2 * n - 1 - s) if name == "zbv" else s % n


def forward_actions(i, s, last):
    return [Action("recv_act", i, s)] * (s > 0) + [Action("forward", i, s)] + \
        [Action("send_act", i, s)] * (s < last)


def backward_actions(i, s, last, op="backward"):
    if op == "backward_weight":
        return [Action(op, i, s)]
    return [Action("recv_grad", i, s)] * (s < last) + [Action(op, i, s)] + \
        [Action("send_grad", i, s)] * (s > 0)


def expand(order, last):
    """(op, micro-batch, stage) in the order a rank computes them -> its actions with messages."""
    return [a for op, i, s in order
            for a in (forward_actions(i, s, last) if op == "forward"
                      else backward_actions(i, s, last, op))]


def gpipe(n, m, rank, v=1):
    """All M forwards, then all M backwards, the last micro-batch's first."""
    return expand([("forward", i, rank) for i in range(m)] +
                  [("backward", i, rank) for i in reversed(range(m))], n - 1)


def one_f_one_b(n, m, rank, v=1, backward="backward"):
    """Forwards until the first gradient can be back (warm-up), then one forward one backward,
    then the remaining backwards (cool-down)."""
    warmup = min(n - 1 - rank, m)
    order = [("forward", i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("forward", warmup + i, rank), (backward, i, rank)]
    return expand(order + [(backward, i, rank) for i in range(m - warmup, m)], n - 1)


def interleaved(n, m, rank, v):
    """Megatron's interleaved 1F1B: rank r holds stages r, r + N, ..., and runs the micro-batches
    in groups of N through one chunk, then the next. Warm-up: 2(N - 1 - r) + (V - 1)N forwards."""
    total = m * v

    def unit(k, backward):  # the k-th (micro-batch, stage) of this rank's forward or backward order
        chunk = (k // n) % v
        return (k // (n * v)) * n + k % n, (v - 1 - chunk if backward else chunk) * n + rank
    warmup = min(total, 2 * (n - 1 - rank) + (v - 1) * n)
    order = [("forward", *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("forward", *unit(warmup + k, False)), ("backward", *unit(k, True))]
    return expand(order + [("backward", *unit(k, True)) for k in range(total - warmup, total)], n * v - 1)


def zb_h1(n, m, rank, v=1):
    """Zero bubble, handcrafted ZB-H1 (Qi et al. 2023): 1F1B with the backward split in B and W,
    one more forward in the warm-up, and each W right after the next B but for rank r's first r
    W, kept for the end, where they fill the cool-down that 1F1B leaves idle. Every rank holds
    at most min(M, N) micro-batches from F to W: 1F1B's peak, on rank 0."""
    warmup, late = min(n - rank, m), min(rank, m)
    order, f, w = [("forward", i, rank) for i in range(warmup)], warmup, 0
    for i in range(m):
        order.append(("backward_input", i, rank))
        if i >= late:
            order.append(("backward_weight", w, rank))
            w += 1
        if f < m:
            order.append(("forward", f, rank))
            f += 1
    return expand(order + [("backward_weight", i, rank) for i in range(w, m)], n - 1)


@functools.cache
def zbv_orders(n, m):
    """Zero bubble V (Qi et al. 2023) for too few micro-batches for the handcrafted lists, found by
    list scheduling on equal F, B, W costs: each slot, each rank runs a B whose gradient is in, else
    a forward whose input is in (the later stage first) while it holds fewer than 2N micro-batch
    chunks (1F1B's peak, N whole stages), else a pending W. This reaches the fewest slots possible
    in one step, 6M + N - 1, for M >= N (N <= 4), but leaves gaps inside a rank's busy window."""
    last, done, clock = 2 * n - 1, {}, 0
    nxt = {(op, s): 0 for op in COST for s in range(2 * n)}  # the next micro-batch of (op, stage)
    orders, held = [[] for _ in range(n)], [0] * n
    while len(done) < 6 * n * m:
        ready = lambda key: done.get(key, math.inf) <= clock
        for r in range(n):
            options = []
            for s in (r, last - r):
                i, j, k = nxt["forward", s], nxt["backward_input", s], nxt["backward_weight", s]
                if j < m and ready(("forward", j, s)) and (s == last or ready(("backward_input", j, s + 1))):
                    options.append((0, 0, "backward_input", j, s))
                if i < m and held[r] < 2 * n and (s == 0 or ready(("forward", i, s - 1))):
                    options.append((1, -s, "forward", i, s))
                if k < j and ready(("backward_input", k, s)):
                    options.append((2, k, "backward_weight", k, s))
            if options:
                _, _, op, i, s = min(options)
                orders[r].append((op, i, s))
                nxt[op, s] += 1
                held[r] += {"forward": 1, "backward_weight": -1}.get(op, 0)
                done[op, i, s] = clock + 1
        clock += 1
    return orders


def zbv(n, m, rank, v=2):
    """ZB-V: the paper's handcrafted lists where there are micro-batches enough (M >= 2N - 1),
    else the list schedule of zbv_orders."""
    return expand(zbv_handcrafted(n, m, rank) if m >= 2 * n - 1 else zbv_orders(n, m)[rank], 2 * n - 1)


def zbv_handcrafted(n, m, rank):
    """Zero bubble V as Qi et al. craft it, for M >= 2N - 1. Chunk a is stage r (down the V), chunk
    b stage 2N-1-r (back up). Warm-up: 2(N-r)-1 forwards of a, r times F b F a, N-r times F b B b
    W b; then F a B a W a F b B b W b until b's forwards are done; cool-down: r times B a B b, N-r
    times B a W a, and the W left, b's first. With equal costs no rank idles between its first
    action and its last, and each holds at most 2N chunks: 1F1B's peak."""
    done, order = collections.Counter(), []

    def run(*ops):
        for op, chunk in ops:
            order.append((op, done[op, chunk], rank if chunk == "a" else 2 * n - 1 - rank))
            done[op, chunk] += 1
    f, b, w = "forward", "backward_input", "backward_weight"
    run(*[(f, "a")] * (2 * (n - rank) - 1))  # warm-up
    run(*[(f, "b"), (f, "a")] * rank)
    run(*[(f, "b"), (b, "b"), (w, "b")] * (n - rank))
    while done[f, "b"] < m:  # steady state: one of each a micro-batch
        run(*[(f, "a")] * (done[f, "a"] < m), (b, "a"), (w, "a"), (f, "b"), (b, "b"), (w, "b"))
    run(*[(b, "a"), (b, "b")] * rank)  # cool-down
    run(*[(b, "a"), (w, "a")] * (n - rank))
    for chunk in "ba":  # the W left
        run(*[(w, chunk)] * (m - done[w, chunk]))
    return order


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1, "zbv": zbv}


def schedule_bound(name, n, m, rank, v=1):
    """The most micro-batch chunks a rank holds between their forward and their backward (their
    W where it is split), in theory; a chunk is 1/V of a stage's layers."""
    return {"gpipe": m, "1f1b": min(m, n - rank), "zb-h1": min(m, n), "zbv": min(2 * m, 2 * n),
            "interleaved": min(m * v, 2 * (n - 1 - rank) + (v - 1) * n + 1)}[name]


def activation_bytes(args, s, stages, after_b=False):
    """The docstring's formula: bytes one micro-batch keeps for backward in stage s from F to B,
    or (after_b) from B to W, each Linear's input and output gradient."""
    b, t, h, a, lo_hi = args.batch_size // args.micro_batches, args.seq_len, args.hidden, args.heads, \
        layer_split(args.layers, stages)[s]
    e, blocks, last = 2 if args.precision == "bf16" else 4, lo_hi[1] - lo_hi[0], s == stages - 1
    if after_b:
        return blocks * 16 * e * b * t * h + last * e * b * t * (h + VOCAB)
    block = {"none": b * t * (8 * h + 14 * e * h + 16) + (4 if e == 4 else 6) * a * b * t * t,
             "selective": b * t * (8 * h + 14 * e * h + 16), "full": 4 * b * t * h}[args.recompute]
    return blocks * block + (s == 0) * 8 * (b * t + t) + last * (b * t * ((4 + e) * h + 4 * VOCAB + 16) + 4)


def bubble_theory(name, n, m, v=1):
    """The idle share of the step when F, B and W each cost the same (a whole backward two)."""
    return {"gpipe": (n - 1) / (m + n - 1), "1f1b": (n - 1) / (m + n - 1),
            "interleaved": (n - 1) / (v * m + n - 1), "zbv": (n - 1) / (6 * m + n - 1),
            "zb-h1": 1 - 3 * m / (2 * m + n - 1 + max(m, n))}[name]


THEORY = {"gpipe": "(N-1)/(M+N-1)", "1f1b": "(N-1)/(M+N-1)", "interleaved": "(N-1)/(VM+N-1)",
          "zb-h1": "1 - 3M/(2M+N-1+max(M,N))", "zbv": "(N-1)/(6M+N-1), reached at M >= N"}
BOUND = {"gpipe": "M", "1f1b": "min(M, N - rank)", "zb-h1": "min(M, N)", "zbv": "min(2M, 2N)",
         "interleaved": "min(VM, 2(N-1-rank) + (V-1)N + 1)"}


def back_to_back_bubble(spans, work):
    """The idle share of the ideal timeline with steps back to back: no collective ends a step, so
    each rank starts the next when it is done, and a step follows every (longest span from a
    rank's first action to its last), the paper's measure. work: one rank's slots of computation."""
    return 1 - work / max(max(e for *_, e in row) - min(b for _, b, _ in row) for row in spans)


def dry_run(schedules, m, ranks):
    """Execute every rank's list on paper as the ranks will (a send never blocks, a receive waits
    until its message has been sent), a forward or B or W one slot, a whole backward two.
    ranks[s] holds stage s.

    Raises ScheduleError unless every rank runs the forward and the backward (or B and W) of each
    micro-batch through each of its stages once, each after its inputs exist, and every message
    is received. Returns per rank the ideal timeline [(label, start, end)] and the peak number of
    micro-batch chunks held between forward and backward (or W)."""
    n, last = len(schedules), len(ranks) - 1
    pc, clock, sent = [0] * n, [0] * n, {}  # sent: (kind, receiving stage, mb) -> its slot
    have = [set() for _ in range(n)]  # (act|grad, mb, stage) received, (op, mb, stage) computed
    spans, held, peak = [[] for _ in range(n)], [0] * n, [0] * n
    chunk = {s: sorted(t for t in range(last + 1) if ranks[t] == ranks[s]).index(s) for s in range(last + 1)}
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pc[r] < len(schedules[r]):
                a = schedules[r][pc[r]]
                op, i, s = a
                if not (0 <= s <= last and ranks[s] == r and 0 <= i < m):
                    raise ScheduleError(f"rank {r}: {a} is not this rank's stage or micro-batch")
                kind = op.split("_")[-1]
                if op.startswith("recv_"):
                    if (kind, s, i) not in sent:
                        break  # blocked until the peer sends
                    clock[r] = max(clock[r], sent.pop((kind, s, i)))
                    have[r].add((kind, i, s))
                elif op.startswith("send_"):
                    to, needs = (s + 1, ["forward"]) if kind == "act" else (s - 1, ["backward", "backward_input"])
                    if not any((x, i, s) in have[r] for x in needs) or not 0 <= to <= last or (kind, to, i) in sent:
                        raise ScheduleError(f"rank {r}: {op} {i} before its {needs[0]}, to no stage, or twice")
                    sent[(kind, to, i)] = clock[r]
                elif op in COST:
                    needs = {"forward": [("act", i, s)] * (s > 0),
                             "backward_weight": [("backward_input", i, s)]}.get(
                        op, [("forward", i, s)] + [("grad", i, s)] * (s < last))
                    twice = {"backward": ["backward", "backward_input"],
                             "backward_input": ["backward", "backward_input"]}.get(op, [op])
                    if any((x, i, s) in have[r] for x in twice) or not all(x in have[r] for x in needs):
                        raise ScheduleError(f"rank {r}: {op} {i} of stage {s} twice, or before {needs}")
                    have[r].add((op, i, s))
                    label = op[0].upper() if op != "backward_weight" else "W"
                    spans[r].append((label + str(i) + ("abcdefgh"[chunk[s]] if last >= n else ""),
                                     clock[r], clock[r] + COST[op]))
                    clock[r] += COST[op]
                    held[r] += {"forward": 1, "backward": -1, "backward_weight": -1}.get(op, 0)
                    peak[r] = max(peak[r], held[r])
                else:
                    raise ScheduleError(f"rank {r}: unknown action {op!r}")
                pc[r] += 1
                moved = True
    stuck = [f"rank {r} at {schedules[r][pc[r]]}" for r in range(n) if pc[r] < len(schedules[r])]
    if stuck:
        raise ScheduleError(f"deadlock: {', '.join(stuck)} wait for messages never sent")
    if sent:
        raise ScheduleError(f"messages never received (kind, stage, micro-batch): {sorted(sent)}")
    for r in range(n):  # each ran at most once and in range: that many means all of them
        work = sum(COST[op] for op, _, _ in (x for x in schedules[r] if x.op in COST))
        if work != 3 * m * sum(1 for s in ranks if s == r) or held[r]:
            raise ScheduleError(f"rank {r} does not run the forward and backward of all {m} "
                                f"micro-batches through each of its stages")
    return spans, peak


# -----------------------------------------------------------------------------
# The model: a GPT-2 style character-level language model, built whole on the CPU, cut into stages
# -----------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it."""
    recompute = "none"  # build_stage gives the ranks' modules --recompute; the reference, "none"

    def __init__(self, hidden, heads, seq_len):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, Linear(hidden, 3 * hidden), Linear(hidden, hidden)
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        core = checkpoint(self.core, q, k, v, use_reentrant=True) if self.recompute == "selective" \
            else self.core(q, k, v)  # selective: q, k, v kept, the rest rerun in backward
        return self.proj(core.transpose(1, 2).reshape(b, t, c))

    def core(self, q, k, v):
        """Scores, mask, softmax (in float32) and times V: what grows with the sequence squared."""
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        t = scores.size(-1)
        return scores.float().masked_fill(self.future[:t, :t], float("-inf")).softmax(dim=-1) @ v


class Block(nn.Module):
    """Pre-LayerNorm decoder block. GELU and LayerNorm keep training a smooth function of the
    weights, so that float32 rounding differences between world sizes stay at rounding level."""

    recompute = "none"

    def __init__(self, hidden, heads, seq_len):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), CausalSelfAttention(hidden, heads, seq_len)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(Linear(hidden, 4 * hidden), nn.GELU(), Linear(4 * hidden, hidden))

    def forward(self, x):  # full: only x is kept, the block reruns in backward
        return checkpoint(self.body, x, use_reentrant=True) if self.recompute == "full" else self.body(x)

    def body(self, x):
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
        self.norm, self.out = nn.LayerNorm(hidden), Linear(hidden, VOCAB, bias=False)

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


def layer_split(layers, stages):
    """Blocks [lo, hi) of each stage, as even as can be. The extra blocks go to the first stages:
    the last also runs the head and the loss, while the embeddings cost next to nothing."""
    sizes = [layers // stages + (s < layers % stages) for s in range(stages)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(stages)]


def stage_slice(layers, s, stages):
    """Stage s's modules in the full nn.Sequential: its blocks, the embeddings first, head last."""
    lo, hi = layer_split(layers, stages)[s]
    return slice(0 if s == 0 else lo + 1, layers + 2 if s == stages - 1 else hi + 1)


def build_stage(args, ranks, rank, device, split_backward):
    """This rank's chunks (stages ranks[s] == rank, in order), cut from the full model built on the
    CPU and moved alone to the device: the rest of the model is freed, never on the device."""
    model = build_model(args)
    stage = nn.ModuleList(model[stage_slice(args.layers, s, len(ranks))]
                          for s in range(len(ranks)) if ranks[s] == rank)
    del model
    stage.hidden = args.hidden
    for m in stage.modules():
        if isinstance(m, (Block, CausalSelfAttention)):
            m.recompute = args.recompute
    for chunk in stage.to(device):
        linear = [m for m in chunk.modules() if isinstance(m, Linear)]
        chunk.later = []
        for m in linear * split_backward:
            m.later = chunk.later
    return stage


def describe_split(layers, ranks):
    parts = [("embeddings + " * (s == 0) + (f"block {lo}" if hi - lo == 1 else
              f"blocks {lo}-{hi - 1}" if hi > lo else "no block") + " + norm, head, loss" * (s == len(ranks) - 1))
             for s, (lo, hi) in enumerate(layer_split(layers, len(ranks)))]
    return " | ".join(f"rank {r}: " + ", ".join(parts[s] for s in range(len(ranks)) if ranks[s] == r)
                      for r in range(max(ranks) + 1))


# -----------------------------------------------------------------------------
# The data: the characters of Python's own source; each batch a function of (seed, step)
# -----------------------------------------------------------------------------
@functools.cache
def load_text():
    """argparse.py, textwrap.py and shlex.py of this Python, every byte >= 128 made '?'."""
    raw = b"".join(open(importlib.util.find_spec(name).origin, "rb").read() for name in SOURCES)
    return torch.tensor([b if b < 128 else ord("?") for b in raw], dtype=torch.long)


def make_batch(seed, step, size, seq_len, ragged=False):
    """The global batch of one step: inputs and next-character targets, from (seed, step) alone.
    ragged: documents of uneven length, 1 to seq_len characters; past its end a sequence is padding
    (inputs 0) whose targets the loss ignores."""
    data = load_text()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - seq_len - 1, (size,), generator=g).tolist()
    x = torch.stack([data[o:o + seq_len] for o in starts])
    y = torch.stack([data[o + 1:o + seq_len + 1] for o in starts])
    if ragged:
        padding = torch.arange(seq_len) >= torch.randint(1, seq_len + 1, (size,), generator=g)[:, None]
        x, y = x.masked_fill(padding, 0), y.masked_fill(padding, IGNORE)
    return x, y


# -----------------------------------------------------------------------------
# The run: the optimizer, the learning rate, the step loop, and main() as a table of contents
# -----------------------------------------------------------------------------
def make_optimizer(args, parameters):
    """--optimizer: SGD, momentum 0.9; or AdamW, float32 moments, weight decay on all parameters."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return torch.optim.SGD(parameters, lr=args.lr, momentum=0.9)


def learning_rate(args, step):
    """A linear warm-up over --warmup-steps W, then --lr, or a cosine from it down towards lr / 10
    at --steps: a function of the step alone, so that a resumed run goes on where it was."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    low, progress = args.lr / 10, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cosine = low + 0.5 * (args.lr - low) * (1 + math.cos(math.pi * progress))  # lr at 0, lr/10 at 1
    return args.lr if args.lr_schedule == "constant" else cosine


def train(args, comm, counted, run, stage, optimizer, actions, ranks, meter, past=((), ())):
    """The steps after the `past` ones (their losses and gradient norms, from a checkpoint). Returns
    this rank's losses of the new steps (0 but on the rank of the last stage), their norms (the same
    on every rank), their timings, and the last step's [start, end) on the timeline."""
    loss_rank, losses, norms, records, window = ranks[-1], [], [], [], None
    norm_comm = counted if args.clip_grad else comm  # no clip: the norm is a report, not counted
    for step in range(len(past[0]), args.steps):
        start, meter.on = time.perf_counter(), step == len(past[0])  # the meter: the first step only
        x, y = (t.to(run.device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        for settings in optimizer.param_groups:
            settings["lr"] = learning_rate(args, step)
        loss, norm = train_step(stage, optimizer, actions, ranks, x, y, args.micro_batches, counted, meter,
                                run.timeline, args.precision, args.clip_grad, norm_comm)
        losses.append(loss), norms.append(norm), records.append(run.timeline.step_record(start))
        window = (start - run.timeline.origin_s, start - run.timeline.origin_s + records[-1]["step_s"])
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:  # the bcast: not counted
            print_progress(comm, args, step, comm.bcast(loss, root=loss_rank), records[-1], norm)
        checkpoint_if_due(comm, args, step, lambda: stage_shard(  # the last stage's rank has losses
            args, stage, optimizer, (list(past[0]) + losses, list(past[1]) + norms)
            if comm.Get_rank() == loss_rank else None), model_config(args))
    return losses, norms, records, window


def model_config(args):
    """The network and optimizer of a checkpoint: no grid, so it resumes on any N, schedule, V."""
    return {"model": "GPT", "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq_len": args.seq_len, "vocab": VOCAB, "optimizer": args.optimizer}


def main(argv=None, comm=MPI.COMM_WORLD):
    """Parse, set up, prove the schedule, train, check, report. Returns this rank's exit status."""
    try:
        args = parse_args(argv, comm.Get_size())
        check_paths(comm, args)
        run = setup(comm, args)
        counted = CountedComm(comm, run.timeline)
        n, m, v, rank = comm.Get_size(), args.micro_batches, args.virtual_stages, comm.Get_rank()
        ranks = [stage_rank(args.schedule, n, s) for s in range(n * v)]
        check_tags(comm, m, n * v)
        # Every rank makes and proves the lists of all ranks, so all reach the same verdict.
        schedules = [SCHEDULES[args.schedule](n, m, r, v) for r in range(n)]
        ideal = dry_run(schedules, m, ranks)
        stage = build_stage(args, ranks, rank, run.device, split_backward=args.schedule in ("zb-h1", "zbv"))
        optimizer = make_optimizer(args, stage.parameters())
        meter = ActivationMeter(stage)
        past, resumed = ([], []), None
        # Checkpoints: each rank saves its chunks' parameters (blocks; the first stage's embeddings,
        # the last's head) and optimizer state, whole tensors under the model's names (no block is
        # cut); the last stage's rank adds losses and norms (stage_shard). At another N, schedule or
        # V, layer_split cuts the stack anew; each rank reads only its new stages' tensors.
        if args.resume:
            resumed, blocks = load_checkpoint(comm, args.save, model_config(args), stage_regions(stage, optimizer),
                                              args.steps)
            if blocks is not None:
                past = restore(stage, optimizer, resumed, blocks)
        print_header(comm, args, run, stage, ranks, resumed)
        run.memory.reset()  # the peak of training alone: not the model's building, nor the check
        losses, norms, records, window = train(args, comm, counted, run, stage, optimizer, schedules[rank], ranks,
                                               meter, past)
        run.memory.stop()
    except ConfigError as e:
        print0(comm, f"error: {e}", file=sys.stderr)
        return e.status
    every = torch.tensor(losses, dtype=torch.float64)
    comm.Bcast(every, root=ranks[-1])  # the rank of the last stage computed them
    losses, norms = list(past[0]) + every.tolist(), list(past[1]) + norms
    diff = check(comm, args, losses, norms, stage, ranks, run.device) if args.check else None
    if args.trace:
        write_trace(comm, run.timeline, args.trace)
    return report(comm, args, run, ideal, ranks, stage, losses, norms, records, window, counted, meter, diff)


# =============================================================================
# You may stop reading here: the strategy is all above. Below, first this file's own machinery
# (the check against single-process training, the report, its arguments and checkpoints), then
# the machinery that every strategy file repeats word for word: the summary, checkpoints and
# signals, counters, timeline and memory, device and MPI setup, arguments.
# =============================================================================

# --- This file's own: the check against single-process training, the report, arguments, checkpoints
# What the reference shares with the ranks, and why each is harmless: build_model and its classes
# (the network; its Linear is nn.Linear while `later` is unset, as it stays here, so the zero-bubble
# split of the backward is the ranks' alone), make_batch, torch's SGD and AdamW (the recipe's settings
# stand on both sides). Its own: the whole model, no stage, schedule or message; its own schedule of
# learning rates, written out; the loss as F.cross_entropy's mean over a micro-batch's valid targets
# times their share of the step's (the ranks: a sum over the step's count); the norm and the clip of
# torch.nn.utils.clip_grad_norm_, which returns the norm. stage_slice only names the parameters each
# rank sends back; the losses and norms, from the uncut model, show a split that drops or repeats a layer.
# It adds up the same micro-batches' gradients in the same order as each stage (gpipe: the last first),
# so that in bf16 each micro-batch's weight gradients are rounded to bf16 apart on both sides, as the
# ranks do; and where the ranks send the residual stream and its gradient in bf16 across a stage boundary
# (or hand it to their own next chunk), it rounds them there too. Measured in bf16, max |diff| of losses,
# norms and parameters, the default model, 60 steps, 1f1b: the whole batch in one backward 1.8e-2 (N = 2)
# and 2.3e-2 (N = 4); the micro-batches alone 3.2e-2 and 9.1e-3, the norms parted by up to 72%; with the
# boundaries rounded too 1.9e-6 and 2.4e-6: the ranks' arithmetic, bf16 included, to float32's reordering.
def reference_training(args, device=torch.device("cpu"), stages=1):
    """The same steps and recipe in one plain process on `device` (rank 0's): the unsplit model, built
    on the CPU and moved, on the batch's micro-batches one after another, the residual stream rounded
    to bf16 and back (and its gradient) where it crosses one of `stages` stages' boundaries in bf16
    runs. Returns the losses, the trained model and the gradient norms."""
    model, lr, warmup, m = build_model(args).to(device), args.lr, args.warmup_steps, args.micro_batches
    wire = torch.bfloat16 if args.precision == "bf16" else torch.float32  # as the ranks send it
    cuts = {stage_slice(args.layers, s, stages).start for s in range(1, stages)}  # where they send it
    optimizer = (torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
                 if args.optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    decay = [lr if args.lr_schedule == "constant" else lr / 10 + 0.5 * (lr - lr / 10) * (
        1 + math.cos(math.pi * k / max(1, args.steps - warmup))) for k in range(args.steps - warmup)]
    schedule, losses, norms = [lr * (k + 1) / warmup for k in range(warmup)] + decay, [], []
    for step in range(args.steps):
        x, y = (t.to(device) for t in make_batch(args.seed, step, args.batch_size, args.seq_len, args.ragged))
        optimizer.zero_grad()
        losses.append(0.0)
        for i in reversed(range(m)) if args.schedule == "gpipe" else range(m):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                h = x.chunk(m)[i]
                for j, module in enumerate(model):  # the uncut model: a split that drops a layer shows
                    h = module(h.to(wire).float() if j in cuts else h)
                logits, targets = h.float().flatten(0, 1), y.chunk(m)[i].flatten()
                loss = F.cross_entropy(logits, targets, ignore_index=-100) * (targets != -100).sum() / (y != -100).sum()
            loss.backward()
            losses[-1] += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad or math.inf).item())
        optimizer.param_groups[0]["lr"] = schedule[step]
        optimizer.step()
    return losses, model, norms

# The gradient norms count as the losses do, but as |norm - reference| / max(reference, 1): bf16
# rounds a norm in proportion to its size (a norm of 2.97 came 1.7e-2 apart, 0.6%, in model_parallel.py's
# 60 default steps with AdamW at N = 1; docs/results.md, "The recipe at each file's default sizes").
def check(comm, args, losses, norms, stage, ranks, device):
    """Rank 0 trains the reference on its device; the other ranks send it their stages' parameters,
    one rank at a time, so that it never holds more than the reference and one stage. Every
    rank gets the largest difference, of the losses, the gradient norms and the parameters."""
    flat, diff = torch.cat([p.detach().reshape(-1).cpu() for p in stage.parameters()]), None
    if comm.Get_rank() != 0:
        request = comm.Isend(flat, dest=0, tag=0)
        while not request.Test():
            time.sleep(POLL_S)  # leave the core to the reference
        return comm.bcast(diff, root=0)
    ref_losses, ref_model, ref_norms = reference_training(args, device, len(ranks))
    scaled = [(n / max(r, 1), r / max(r, 1)) for n, r in zip(norms, ref_norms)]  # the norms: relative (above)
    losses, ref_losses = losses + [n for n, _ in scaled], ref_losses + [r for _, r in scaled]
    diff = max_difference(losses, {}, ref_losses, ref_model)
    for r in range(comm.Get_size()):
        shapes = {name: p.shape for s in range(len(ranks)) if ranks[s] == r  # a slice keeps the full model's names
                  for name, p in ref_model[stage_slice(args.layers, s, len(ranks))].named_parameters()}
        if r:
            flat = torch.empty(sum(shape.numel() for shape in shapes.values()))
            comm.Recv(flat, source=r, tag=0)
        pieces = flat.split([shape.numel() for shape in shapes.values()])
        state = {name: piece.view(shape) for (name, shape), piece in zip(shapes.items(), pieces)}
        diff = max(diff, max_difference(losses, state, ref_losses, ref_model))
    return comm.bcast(diff, root=0)

def print_header(comm, args, run, stage, ranks, resumed):
    n, m, v = comm.Get_size(), args.micro_batches, args.virtual_stages
    params = sum(p.numel() for p in build_model(args).parameters()) if comm.Get_rank() == 0 else 0
    stage_params = comm.allgather(sum(p.numel() for p in stage.parameters()))
    if resumed:
        written = resumed["state"]["grid"]  # the grid that wrote it: any other resumes it
        print0(comm, f"resumed from {args.save} at step {resumed['step']} (written by {resumed['world_size']} "
                     f"ranks) with --schedule {written['schedule']}"
                     + (f", {written['virtual_stages']} chunks per rank" if written["virtual_stages"] > 1 else ""))
    print0(comm, *run.header,
           f"model: GPT, {args.layers} blocks x {args.hidden} hidden x {args.heads} heads, {params:,} parameters "
           f"({4 * params / 1e6:.2f} MB) | text: {' + '.join(s + '.py' for s in SOURCES)}, "
           f"{len(load_text()):,} characters",
           f"stages: {describe_split(args.layers, ranks)} | parameters per rank: "
           f"{' '.join(f'{k:,}' for k in stage_params)}",
           f"schedule {args.schedule}{f' ({v} chunks per rank)' if v > 1 else ''} | global batch "
           f"{args.batch_size} = {m} micro-batches x {args.batch_size // m} sequences of {args.seq_len} characters"
           f" | between stages: {[args.batch_size // m, args.seq_len, args.hidden] if n > 1 else 'nothing'} "
           f"{'bfloat16' if args.precision == 'bf16' else 'float32'} | recompute {args.recompute} | dry run of every rank's actions: each send meets its receive, each input exists before "
           f"use, no deadlock")

def report(comm, args, run, ideal, ranks, stage, losses, norms, records, window, counted, meter, diff):
    """The timelines, the bubble, memory, messages and overlap; then finish() (the split of a step,
    the verdict, --json). Returns the exit status."""
    n, m, v, steps_run = comm.Get_size(), args.micro_batches, args.virtual_stages, max(1, len(records))
    split = args.schedule in ("zb-h1", "zbv")  # B and W apart: a micro-batch also holds W's tensors
    messages = comm.allreduce(counted.calls["Isend"] / steps_run)
    sent = comm.allreduce(counted.bytes["Isend"] / steps_run)
    collectives, summed = counted.calls["Allreduce"] / steps_run, comm.allreduce(counted.bytes["Allreduce"] / steps_run)
    (spans, ideal_peak), slots = ideal, max(e for row in ideal[0] for _, _, e in row)
    width = len(f"B{m - 1}") + 1 + (v > 1)
    measured = measured_timeline(comm, run.timeline, window, width, 2 * slots)
    peaks = comm.allgather((meter.peak_count, meter.peak_bytes, meter.per_mb))
    waits = comm.allgather(statistics.median(r["wait_s"] / r["step_s"] for r in records[1:] or records))
    theory, bubble, dry_bubble = bubble_theory(args.schedule, n, m, v), statistics.mean(waits), 1 - 3 * m * v / slots
    back_to_back = back_to_back_bubble(spans, 3 * m * v)
    bounds = [schedule_bound(args.schedule, n, m, r, v) for r in range(n)]
    crossings = sum(a != b for a, b in zip(ranks, ranks[1:]))  # stage boundaries between two ranks
    e = 2 if args.precision == "bf16" else 4  # bytes of an element on the wire
    formula = 2 * crossings * args.batch_size * args.seq_len * args.hidden * e
    one = [max(max(activation_bytes(args, s, n * v), activation_bytes(args, s, n * v, after_b=True) * split)
               for s in range(n * v) if ranks[s] == r) for r in range(n)]  # a micro-batch chunk, in theory
    kept = 3 + (args.optimizer == "adamw")  # parameters, gradients, SGD's momentum or AdamW's two moments
    states = comm.allgather(kept * sum(p.numel() * p.element_size() for p in stage.parameters()))
    expected = [s + p[1] for s, p in zip(states, peaks)]
    in_flight = [comm.allreduce(c) for c in sends_in_flight(run.timeline.step_events)]  # over the ranks: not counted
    lines = [f"final loss {losses[-1]:.4f} (first step {losses[0]:.4f}) | gradient norm, last step {norms[-1]:.4f}; "
             f"clipped at {sum(n > args.clip_grad > 0 for n in norms)} of {len(norms)} steps",
             f"ideal timeline (the dry run; F/B/W: forward/backward/weights' gradients of micro-batch i, one "
             f"slot each, a whole backward B two{', a/b...: the chunk' if v > 1 else ''}; '.': idle) | bubble "
             f"{100 * dry_bubble:.0f}% of one step, {100 * back_to_back:.0f}% with steps back to back:",
             *draw_timeline(spans, slots, slots, width),
             "measured timeline (the last step; o: optimizer, '.': waiting for a peer or communicating):",
             *measured,
             f"bubble: measured {100 * bubble:.0f}% of the step waiting for a peer (per rank "
             f"{' '.join(f'{100 * w:.0f}%' for w in waits)}) | theory {THEORY[args.schedule]} = {100 * theory:.1f}%",
             f"micro-batch chunks held at once (counted: the tensors autograd saved for backward or W), peak per "
             f"rank: {' '.join(str(p[0]) for p in peaks)} | bound {BOUND[args.schedule]}: {' '.join(map(str, bounds))}"
             f" | those tensors at their peak: {' '.join(f'{p[1] / 1e6:.3f}' for p in peaks)} MB, at most bound x one "
             f"chunk's {' '.join(f'{b * o / 1e6:.3f}' for b, o in zip(bounds, one))} | one chunk (recompute "
             f"{args.recompute}{', F to B or B to W' * split}): {' '.join(f'{p[2] / 1e6:.3f}' for p in peaks)} MB, "
             f"formula {' '.join(f'{o / 1e6:.3f}' for o in one)}",
             f"memory per rank: stage states (parameters, gradients, optimizer: {kept} x 4 bytes a parameter) + those "
             f"tensors at their peak = {' | '.join(f'{b / 1e6:.2f}' for b in expected)} MB; measured peak "
             f"{' | '.join(f'{b / 1e6:.2f}' for b in comm.allgather(run.memory.bytes))} MB",
             f"point-to-point: {messages:g} messages, {sent:,.0f} bytes/step over all ranks; 2K x B x T x H x {e} = "
             f"{formula:,} with K = {crossings} stage boundaries between ranks | "
             + (f"{collectives:g} allreduce of {summed:g} bytes over all ranks (the norm, for --clip-grad)"
                if collectives else "no collective in the step (the norm, a report, is not counted)")]
    return finish(comm, args, run, losses, records, diff, "losses, gradient norms, parameters", lines, {
        "comm_bytes_per_step": sent + summed, "collectives_per_step": collectives, "schedule": args.schedule,
        "grad_norms": norms,
        "micro_batches": m, "virtual_stages": v, "messages_per_step": messages,
        "layer_split": layer_split(args.layers, n * v), "stage_ranks": ranks,
        "stage_params": comm.allgather(sum(p.numel() for p in stage.parameters())),
        "bubble_fraction": bubble, "bubble_fraction_ranks": waits, "bubble_fraction_theory": theory,
        "bubble_fraction_dry_run": dry_bubble, "bubble_fraction_back_to_back_dry_run": back_to_back,
        "peak_activations": [p[0] for p in peaks], "peak_activations_bound": bounds,
        "peak_activations_dry_run": ideal_peak, "peak_activation_bytes": [p[1] for p in peaks],
        "activation_bytes_per_micro_batch": [p[2] for p in peaks], "stage_state_bytes": states,
        "activation_bytes_per_rank": [p[1] for p in peaks], "activation_bytes_per_micro_batch_formula": one,
        "activation_bytes_bound": [b * o for b, o in zip(bounds, one)],
        "memory_formula_bytes": expected, "overlap": {"sends_in_flight_during_compute": in_flight}})

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
    """The last step as every rank lived it, from rank 0's start, which runs the first forward, to
    the end of the last rank to finish. A cell lasts a typical forward, the fastest rank's median."""
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
    (a Test, which never blocks, does not end it); n: the sends in whose flight a forward, a backward or a W
    began, that is, the rank computed instead of waiting for them. The schedule decides it, not the library's speed: every send
    that has a computation after it in the rank's list of actions, since the step waits for its
    sends at its end only."""
    compute = [b for name, cat, b, _ in events if cat == "compute" and name != "optimizer"]
    waits = sorted(b for name, _, b, _ in events if name == "Isend wait") + [math.inf]
    flights = [(b, next(w for w in waits if w >= b)) for name, _, b, _ in events if name == "Isend"]
    return [sum(any(lo <= c < hi for c in compute) for lo, hi in flights), len(flights)]

def parse_args(argv, world_size):
    p = common_arguments("Pipeline parallelism over MPI: a small GPT on Python's own source.",
                         steps=60, batch_size=16, lr=1e-3, log_every=20)
    p.add_argument("--layers", type=COUNT, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, default=64, help="hidden size")
    p.add_argument("--heads", type=COUNT, default=4, help="attention heads")
    p.add_argument("--seq-len", type=COUNT, default=64, help="characters per sequence")
    p.add_argument("--micro-batches", type=COUNT, default=8, help="micro-batches per global batch")
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b", help="pipeline schedule")
    p.add_argument("--virtual-stages", type=COUNT, help="chunks of layers per rank for --schedule interleaved (default 2)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw",
                   help="SGD with momentum 0.9, or AdamW (betas 0.9, 0.95, eps 1e-8, weight decay 0.1)")
    p.add_argument("--clip-grad", type=checked(float, lambda v: v >= 0 and math.isfinite(v), "0 or more"), default=1.0,
                   metavar="MAX_NORM", help="clip the global gradient norm to MAX_NORM, as clip_grad_norm_ (0: off)")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after the warm-up: --lr throughout, or a cosine from --lr towards lr / 10 at --steps")
    p.add_argument("--warmup-steps", type=COUNT_OR_0, help="linear warm-up: step s gets lr (s + 1) / W (default: --steps / 10)")
    p.add_argument("--ragged", action="store_true", help="documents of uneven length: targets past a document's end ignored")
    args = check_common(p.parse_args(argv))
    args.warmup_steps = args.steps // 10 if args.warmup_steps is None else args.warmup_steps  # a tenth by default
    if args.warmup_steps >= args.steps:  # a warm-up that takes every step
        raise ConfigError(f"--warmup-steps {args.warmup_steps} must be below --steps {args.steps}: fewer or more steps")
    if args.hidden % args.heads:
        raise ConfigError(f"--hidden {args.hidden} does not split into {args.heads} heads; use a "
                          f"multiple of {args.heads}, or --heads that divides {args.hidden}")
    if args.seq_len > len(load_text()) - 2:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the text; use at most {len(load_text()) - 2}")
    if args.layers < world_size:
        raise ConfigError(f"--layers {args.layers} cannot fill {world_size} stages, one per rank; "
                          f"use --layers {world_size} or more, or at most {args.layers} ranks")
    if args.batch_size % args.micro_batches:
        works = ", ".join(str(m) for m in range(1, args.batch_size + 1) if args.batch_size % m == 0)
        raise ConfigError(f"--batch-size {args.batch_size} does not split into {args.micro_batches} "
                          f"micro-batches; use --micro-batches {works}, or a --batch-size multiple "
                          f"of {args.micro_batches}")
    if args.virtual_stages is not None and args.schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {args.virtual_stages}: use it with --schedule interleaved only "
                          f"(zbv always has 2 chunks per rank, the others 1)")
    args.virtual_stages = chunks_of(args.schedule, args.virtual_stages or 2)
    if args.schedule == "interleaved" and args.micro_batches % world_size:
        works = [m for m in range(world_size, args.batch_size + 1, world_size) if args.batch_size % m == 0]
        raise ConfigError(f"--schedule interleaved runs the micro-batches in groups of N = {world_size}: use "
                          + (f"--micro-batches {', '.join(map(str, works))}" if works else
                             f"a --batch-size multiple of {world_size}") + f", not {args.micro_batches}")
    return args

def chunk_parameters(stage):
    """(name, parameter) of this rank's chunks, under the whole model's names: a chunk is a slice of
    build_model's nn.Sequential, which keeps them (the embeddings 0, block i i + 1, the head L + 1)."""
    return [(name, p) for chunk in stage for name, p in chunk.named_parameters()]

# A parameter's optimizer state as a checkpoint names it (<kind>/<name>, whole as the parameter), and as torch does
MOMENTS = {torch.optim.SGD: {"momentum": "momentum_buffer"},
           torch.optim.AdamW: {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}

def stage_shard(args, stage, optimizer, so_far):
    """What this rank saves: its chunks' parameters and their optimizer state (momentum/<name>, or
    exp_avg/ and exp_avg_sq/<name>), each a whole tensor, since a block is never cut; with so_far,
    (losses, norms) on the last stage's rank, the state: those, AdamW's step count and the grid."""
    kinds, steps = MOMENTS[type(optimizer)], [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    pieces = {key: piece(t) for name, p in chunk_parameters(stage)
              for key, t in [(name, p)] + [(f"{k}/{name}", optimizer.state[p][v]) for k, v in kinds.items()]}
    return pieces, None if so_far is None else {"losses": so_far[0], "grad_norms": so_far[1], **(
        {"adamw_step": steps[0]} if steps else {}), "grid": {"schedule": args.schedule, "virtual_stages": args.virtual_stages}}

def stage_regions(stage, optimizer):
    """load_checkpoint's wanted(): every parameter of this rank's chunks on the new grid, and its optimizer state."""
    return lambda manifest: {key: region(p.shape) for name, p in chunk_parameters(stage)
                             for key in (name, *(f"{kind}/{name}" for kind in MOMENTS[type(optimizer)]))}

def restore(stage, optimizer, manifest, blocks):
    """The parameters and optimizer state of this rank's chunks from their blocks, wherever the grid
    that wrote them had put them. Returns the losses and the gradient norms so far."""
    state = manifest["state"]
    with torch.no_grad():
        for name, p in chunk_parameters(stage):
            p.copy_(blocks[name])
            optimizer.state[p].update({v: blocks[f"{k}/{name}"].to(p.device) for k, v in MOMENTS[type(optimizer)].items()})
            if "adamw_step" in state:  # torch keeps it for each parameter, as a float32 tensor on the CPU
                optimizer.state[p]["step"] = torch.tensor(float(state["adamw_step"]))
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
