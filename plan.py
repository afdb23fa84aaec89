"""Which grid? Memory and step time per GPU for a GPT on any grid of data, tensor, pipeline, context
and expert parallelism, from the formulas the strategy files state and measure.

    python plan.py --layers 80 --hidden 8192 --heads 64 --seq-len 4096 --vocab 128256 \
                   --batch-size 512 --gpus 256 --gpu h200                  # the grids that fit, best first
    python plan.py ... --grid dp=4,tp=8,pp=8,micro=32                      # one grid, every term
    python plan.py ... --json                                              # {"plans": [...]} on one line

What it adds up, per GPU and per optimizer step (B sequences of s tokens, L blocks, hidden h, a heads,
vocabulary V; a grid of dp x tp x pp x cp GPUs, ep of the dp ranks sharing the experts out):

  memory     weights, gradients, optimizer state (ZeRO stage 0-3 over the dp x cp ranks) and the
             activations that the pipeline schedule keeps alive, by --precision and --recompute
  bytes      handed to the network on each axis (data, tensor, pipeline, context, expert)
  bubble     the pipeline schedule's idle share of the step
  time       compute at a stated fraction of the GPU's peak (--efficiency), plus the communication
             not hidden, each exchange alpha + bytes / beta on its link (NVLink inside a node,
             InfiniBand across), hence tokens per second per GPU and model FLOPs utilisation

Where each formula comes from (every one of them is stated in that file's docstring and measured by
that file's run; tests/test_plan.py holds plan.py's bytes to those measurements, exactly):

  parameters      hybrid_parallel.py, docstring "Communication per step", data: W, the parameters of a
                  replica, the vocabulary padded to a multiple of tp, plus (tp - 1) x (sh + 6Lh + 2h) held
                  whole on every tensor-parallel rank; sharded_data_parallel.py's GPT drops the key bias
  tensor axis     tensor_parallel.py, docstring "Communication per step": (4L + 2) x A + 12 bs bytes handed
                  to MPI (A = the activation of one micro-batch), 3 fp32 allreduces of bs for the loss;
                  sequence parallel: reduce-scatters hand in A, all-gathers A/tp, plus one allreduce of the
                  4(6L + 2 + s)h bytes of replicated gradients; hybrid_parallel.py: per stage
  pipeline axis   pipeline_parallel.py, docstring "Communication per step": 2K x B x s x h x bytes in 2MK
                  messages, K stage boundaries (P - 1; PV - 1 interleaved; 2P - 2 for zbv)
  data axis       data_parallel.py, "Communication per step": one allreduce of G = 4 bytes x parameters;
                  sharded_data_parallel.py, "Communication per step": ZeRO 1 and 2 hand 2 x G, stage 3 3 x G,
                  each layer's flat vector padded to a multiple of the ranks
  context axis    context_parallel.py, "Communication per step and rank": ring L x 2S x (3N - 2), all-gather
                  L x 2S x (N + 2), all-to-all L x 8S, S = one rank's K of one layer; + 8 (the loss, float64)
  expert axis     expert_parallel.py, "Communication per step": 4 L k n h x bytes by Alltoallv, L E 8 for the
                  counts and L E 8 for the router's counts; dense gradients over all data ranks, expert
                  gradients over the dp / ep copies of each expert
  bubble          pipeline_parallel.py, docstring "The bubble": (P-1)/(M+P-1) gpipe and 1f1b, (P-1)/(VM+P-1)
                  interleaved, 1 - 3M/(2M+P-1+max(M,P)) zb-h1, (P-1)/(6M+P-1) zbv
  memory          sharded_data_parallel.py, "Memory per rank": 4 + 4 + 8 bytes a parameter (AdamW), stage 1
                  8Psi + 8Psi/N, stage 2 4Psi + 12Psi/N + W, stage 3 16Psi/N + 2W (W: the largest two
                  neighbouring layers); pipeline_parallel.py, "Peak memory": micro-batches held, min(M, P)
                  for 1f1b on the first stage; tensor_parallel.py, "Activations saved for backward":
                  float32 and no dropout turn Korthikanti et al.'s sbh(10 + 24/t + 5as/(ht)) into
                  sbh(16 + 48/t) + 4as^2b/t bytes a block (Megatron's sequence parallelism: (sbh/t)(64 + 4as/h))
  precision       bf16 as the files add it (autocast on float32 master weights): 2-byte bf16 weight copies,
                  float32 gradients reduced in float32, float32 optimizer state, and (Megatron's way) 2-byte
                  activations, saved and exchanged; fp32: 4 bytes everywhere
  recompute       none; selective drops attention's scores (Korthikanti et al. 2022); full keeps each
                  block's input and recomputes one block at a time in backward (4 passes of compute, not 3)
  FLOPs           Narayanan et al. 2021, eq. 3: 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with full recompute;
                  72 B s L h^2 (1 + s/(6h) + V/(12 L h)) without; MFU counts the model's 72-formula FLOPs

What it does not model: overlap beyond what the files do (the data axis hides behind the last
micro-batch's backward; tensor and context exchanges are exposed; pipeline sends cost alpha + bytes/beta
per micro-batch and boundary), kernels other than matrix products at --efficiency, the optimizer's
memory traffic at HBM speed, memory fragmentation (a grid fits when its total is within --usable of HBM).
"""
import argparse
import dataclasses
import json
import os
import sys

# -----------------------------------------------------------------------------
# Hardware: peak bf16 dense matrix FLOP/s, HBM, links (alpha: latency s, beta: bytes/s per GPU, one way)
# -----------------------------------------------------------------------------
# A100 SXM 80GB: 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32 (no TF32), 80 GB HBM2e at 2,039 GB/s, NVLink 3
#   600 GB/s per GPU both ways (NVIDIA A100 Tensor Core GPU datasheet); DGX A100: 8 GPUs, 8 ConnectX-6
#   HDR 200 Gb/s, one per GPU (25 GB/s; NVIDIA DGX A100 datasheet). Narayanan et al. 2021 ran on these.
# H100 SXM 80GB: 989 TFLOP/s bf16 dense (1,979 with sparsity), 67 TFLOP/s fp32, 80 GB HBM3 at 3.35 TB/s,
#   NVLink 4 900 GB/s both ways (NVIDIA H100 Tensor Core GPU datasheet); DGX H100: 8 GPUs, 8 ConnectX-7
#   NDR 400 Gb/s, one per GPU (50 GB/s; NVIDIA DGX H100 datasheet).
# H200 SXM: the H100's compute and NVLink, 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 Tensor Core GPU
#   datasheet); DGX H200 as DGX H100: 8 ConnectX-7 NDR 400 Gb/s.
# The latencies are assumptions, not datasheet figures: 5 us a step of a collective inside a node and
# 10 us across (the order NCCL's small messages take); --alpha-intra and --alpha-inter change them.
@dataclasses.dataclass
class Hardware:
    name: str
    peak: dict           # FLOP/s by precision, dense
    hbm: float           # bytes of memory per GPU
    hbm_bandwidth: float
    gpus_per_node: int
    intra: tuple         # (alpha s, beta bytes/s one way) inside a node
    inter: tuple         # the same across nodes, per GPU (one NIC each)
    cores: int = 0       # a CPU: its ranks share these cores (peak is then FLOP/s per core); 0 for GPUs

    def rate(self, precision, ranks):
        """FLOP/s of one rank: a GPU's peak; on a CPU, its share of the cores (the files give each of
        N ranks cores // N threads, and ranks beyond the cores take turns)."""
        if not self.cores:
            return self.peak[precision]
        return self.peak[precision] * (self.cores // ranks if ranks <= self.cores else self.cores / ranks)


GiB = 2 ** 30
PRESETS = {
    "a100": Hardware("A100 SXM 80GB, 8 a node (DGX A100)", {"bf16": 312e12, "fp32": 19.5e12}, 80 * GiB,
                     2.039e12, 8, (5e-6, 300e9), (10e-6, 25e9)),
    "h100": Hardware("H100 SXM 80GB, 8 a node (DGX H100)", {"bf16": 989e12, "fp32": 67e12}, 80 * GiB,
                     3.35e12, 8, (5e-6, 450e9), (10e-6, 50e9)),
    "h200": Hardware("H200 SXM 141GB, 8 a node (DGX H200)", {"bf16": 989e12, "fp32": 67e12}, 141e9,
                     4.8e12, 8, (5e-6, 450e9), (10e-6, 50e9)),
}
# --gpu cpu: this machine, its ranks sharing its cores. Its FLOP/s are calibrated from a measured run
# (--calibrate, below); its links are MPI's shared memory: the alpha and beta here are assumptions
# (20 us, 2 GB/s) that the step-time test leaves to the calibration's error to judge.
CPU_ALPHA, CPU_BETA = 20e-6, 2e9


def machine_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_hardware(flops_per_core, cores=None):
    cores, memory = cores or machine_cores(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(f"CPU ranks sharing {cores} cores", {"bf16": flops_per_core, "fp32": flops_per_core}, memory,
                    10e9, 1 << 20, (CPU_ALPHA, CPU_BETA), (CPU_ALPHA, CPU_BETA), cores)


# -----------------------------------------------------------------------------
# The model, the grid, and the GPT's parameters on each GPU
# -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int = 128          # the files' ASCII codes
    experts: int = 1          # > 1: every block's MLP is a mixture (expert_parallel.py)
    top_k: int = 1
    key_bias: bool = True     # sharded_data_parallel.py's GPT has none (its Block's docstring)


@dataclasses.dataclass(frozen=True)
class Grid:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro: int = 1            # M, micro-batches per replica's share of the batch
    schedule: str = "1f1b"
    virtual: int = 1          # V, chunks per rank (interleaved)
    sp: bool = False          # Megatron's sequence parallelism on the tensor axis
    cp_comm: str = "ring"

    @property
    def gpus(self):
        return self.dp * self.tp * self.pp * self.cp


def layer_split(layers, stages):
    """Blocks [lo, hi) of each stage: the extra blocks to the first stages (pipeline_parallel.py's split)."""
    sizes = [layers // stages + (s < layers % stages) for s in range(stages)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(stages)]


def padded_vocab(vocab, tp):
    return -(-vocab // tp) * tp


def stage_layers(m, g, stage):
    """The flat layers one GPU of `stage` holds, as ZeRO flattens them (sharded_data_parallel.py: the
    embeddings, each block, the final norm with the head), in parameters: (dense, expert) for each.
    Column-parallel weights and biases and the vocabulary are split over tp; LayerNorms, positions and
    row-parallel biases are whole on every tensor-parallel rank (hybrid_parallel.py's W)."""
    h, t, (lo, hi) = m.hidden, g.tp, layer_split(m.layers, g.pp)[stage]
    v = padded_vocab(m.vocab, t)
    qkv_bias = 3 * h if m.key_bias else 2 * h
    attention = (4 * h * h + qkv_bias) // t + h + 2 * h           # qkv, proj (bias whole), ln1
    if m.experts > 1:   # ln2 and the router whole; E/ep experts of fc1, fc2 (8h^2 + 5h each)
        block = [(attention + 2 * h + h * m.experts, m.experts // g.ep * ((8 * h * h + 4 * h) // t + h))
                 for _ in range(lo, hi)]
    else:
        block = [(attention + (8 * h * h + 4 * h) // t + h + 2 * h, 0) for _ in range(lo, hi)]
    first = [(v * h // t + m.seq_len * h, 0)] if stage == 0 else []
    last = [(2 * h + v * h // t, 0)] if stage == g.pp - 1 else []
    return first + block + last


# -----------------------------------------------------------------------------
# Bytes per step on each axis: what one GPU hands to the network (the files' count, at the MPI calls)
# -----------------------------------------------------------------------------
def act_bytes(precision):
    """An activation element, saved or exchanged: Megatron's 2 bytes in bf16, 4 in fp32."""
    return 2 if precision == "bf16" else 4


def axis_bytes(m, g, batch, stage, precision):
    """Bytes one GPU of `stage` hands to MPI per step on each axis (the same on every GPU of a stage,
    the expert axis on average). Gradients are float32 whatever the precision; so is the loss."""
    e, h, s, t = act_bytes(precision), m.hidden, m.seq_len, g.tp
    lo, hi = layer_split(m.layers, g.pp)[stage]
    blocks, first, last = hi - lo, stage == 0, stage == g.pp - 1
    share = batch // g.dp                     # sequences of this replica, all micro-batches together
    tokens = share * s // g.cp                # tokens this GPU computes per step
    A = e * tokens * h                        # one activation of all micro-batches together
    out = {"data": 0, "tensor": 0, "pipeline": 0, "context": 0, "expert": 0}
    layers = stage_layers(m, g, stage)
    dense, expert = sum(d for d, _ in layers), sum(x for _, x in layers)
    if g.dp * g.cp > 1:                       # gradients: over every rank that saw other data
        if g.zero:
            padded = sum(-(-(d + x) // (g.dp * g.cp)) * g.dp * g.cp for d, x in layers)
            # stage 3 gathers each layer before its forward and its backward and reduce-scatters its
            # gradient, once per micro-batch (the file's step is one micro-batch: 3 G)
            out["data"] = (2 if g.zero < 3 else 3 * g.micro) * 4 * padded
        else:
            out["data"] = 4 * dense + (4 * expert if g.dp * g.cp // g.ep > 1 else 0)
    if t > 1:
        exchanges = 4 * blocks + first + last  # f and f-bar: 2 a block forward, 2 backward, embedding, head
        loss = 3 * 4 * tokens if last else 0
        if g.sp:
            replicated = 6 * h * blocks + (s * h if first else 0) + (2 * h if last else 0)
            out["tensor"] = exchanges * (A + A // t) + loss + 4 * replicated
        else:
            out["tensor"] = exchanges * A + loss
    if g.pp > 1:   # sends only, each micro-batch's activation or its gradient: forward unless the last
        # chunk of the model, backward unless the first (zbv: a rank's two chunks meet on the last rank)
        sends = ((2 if first or last else 4) if g.schedule == "zbv"
                 else 2 * g.virtual - first - last if g.schedule == "interleaved" else (not last) + (not first))
        out["pipeline"] = sends * e * tokens * h
    if g.cp > 1:
        S, N = e * tokens * h // t, g.cp      # one rank's K of one layer (its heads, its positions)
        per_layer = {"ring": 2 * S * (3 * N - 2), "allgather": 2 * S * (N + 2), "alltoall": 8 * S}[g.cp_comm]
        out["context"] = blocks * per_layer + 8
    if m.experts > 1 and g.ep > 1:
        out["expert"] = 4 * blocks * m.top_k * tokens * h * e + 2 * blocks * m.experts * 8
    return out


def representative_stages(pp):
    """The stages that can be the busiest: the first (embeddings, the most blocks, the most micro-batches
    in flight), the second (the most of the middle ones: extra blocks go to the first stages), the last
    (the head and the loss). Every other stage holds no more and computes no more than the second."""
    return sorted({0, min(1, pp - 1), pp - 1})


def grid_bytes(m, g, batch, precision):
    """Per step: the busiest GPU's bytes on each axis, and the sum over every GPU of the grid."""
    stages = [axis_bytes(m, g, batch, s, precision) for s in range(g.pp)]
    busiest = {axis: max(b[axis] for b in stages) for axis in stages[0]}
    total = {axis: sum(b[axis] for b in stages) * g.dp * g.tp * g.cp for axis in stages[0]}
    return busiest, total


# -----------------------------------------------------------------------------
# Memory per GPU: weights, gradients, optimizer state, activations
# -----------------------------------------------------------------------------
def bubble(g):
    """pipeline_parallel.py's docstring, "The bubble"."""
    P, M, V = g.pp, g.micro, g.virtual
    if P == 1:
        return 0.0
    if g.schedule == "interleaved":
        return (P - 1) / (V * M + P - 1)
    if g.schedule == "zb-h1":
        return 1 - 3 * M / (2 * M + P - 1 + max(M, P))
    if g.schedule == "zbv":
        return (P - 1) / (6 * M + P - 1)
    return (P - 1) / (M + P - 1)


def in_flight(g, stage):
    """Micro-batches (of a stage's layers) held from forward to backward at the peak: pipeline_parallel.py,
    "Peak memory": gpipe M, 1f1b min(M, P - r), zb-h1 min(M, P), zbv min(2M, 2P) half stages, interleaved
    (its bound in stages) min(VM, 2(P-1-r) + (V-1)P + 1) chunks of 1/V of a stage."""
    P, M, V, r = g.pp, g.micro, g.virtual, stage
    return {"gpipe": M, "1f1b": min(M, P - r), "zb-h1": min(M, P), "zbv": min(2 * M, 2 * P) / 2,
            "interleaved": min(V * M, 2 * (P - 1 - r) + (V - 1) * P + 1) / V}[g.schedule]


def block_activations(m, g, tokens, precision, recompute):
    """Bytes one block saves for backward for `tokens` tokens of one micro-batch on one GPU.
    tensor_parallel.py's docstring: sbh(16 + 48/t) + 4as^2b/t in float32 without dropout (Korthikanti
    et al.'s terms: LayerNorm inputs, qkv's and fc1's inputs whole, 12 elements split by t: q, k, v,
    attention's output, fc1's output and GELU's; the scores, one a x s x s per sequence); Megatron's
    sequence parallelism splits the whole ones too: (sbh/t)(64 + 4as/h). Selective recomputation
    drops the scores; full keeps the block's input alone. Context parallelism never saves the scores
    (context_parallel.py: backward recomputes them). A mixture keeps k copies of the MLP's inputs."""
    e, h, t, a = act_bytes(precision), m.hidden, g.tp, m.heads
    s_local, sequences = m.seq_len // g.cp, tokens / (m.seq_len // g.cp)
    if recompute == "full":
        return e * tokens * h / (t if g.sp else 1)
    whole, split = 4, 12                       # elements per token and h: the docstring's 16/4 and 48/4
    if m.experts > 1:
        split += 9 * (m.top_k - 1)             # fc1's input (1), its output and GELU's (4 + 4), per choice
    per = e * tokens * h * ((whole + split) / t if g.sp else whole + split / t)
    if recompute == "none" and g.cp == 1:
        per += e * a * sequences * s_local * m.seq_len / t
    return per


def memory(m, g, batch, precision, recompute, optimizer, stage):
    """Bytes on one GPU of `stage` at the peak of a step, by kind."""
    layers = stage_layers(m, g, stage)
    sizes = [d + x for d, x in layers]
    n = g.dp * g.cp if g.zero else 1          # ZeRO shards over every rank that holds the same weights
    psi = sum(-(-p // n) * n for p in sizes) if g.zero else sum(sizes)
    pair = 4 * max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0])  # W: two neighbours
    state = 8 if optimizer == "adam" else 4
    out = {"weights": 4 * psi / (n if g.zero == 3 else 1) + (pair if g.zero == 3 else 0),
           "gradients": 4 * psi / (n if g.zero >= 2 else 1) + (pair if g.zero >= 2 else 0),
           "optimizer": state * psi / (n if g.zero >= 1 else 1)}
    if precision == "bf16":                   # autocast's bf16 copies of the weights it uses
        out["weights"] += 2 * (pair / 4 if g.zero == 3 else psi)
    lo, hi = layer_split(m.layers, g.pp)[stage]
    tokens = batch // g.dp // g.micro * m.seq_len // g.cp   # one micro-batch on this GPU
    e, h = act_bytes(precision), m.hidden
    per_block = block_activations(m, g, tokens, precision, recompute)
    acts = in_flight(g, stage) * (hi - lo) * per_block
    if recompute == "full":                   # one block's whole activations while it is recomputed
        acts += block_activations(m, g, tokens, precision, "none")
    if stage == g.pp - 1:                     # final norm's and head's inputs, float32 logits
        acts += in_flight(g, stage) * (2 * e * tokens * h + 4 * tokens * padded_vocab(m.vocab, g.tp) / g.tp)
    out["activations"] = acts
    out["total"] = sum(out.values())
    return out


# -----------------------------------------------------------------------------
# Time per step: compute at a fraction of peak, and the communication not hidden
# -----------------------------------------------------------------------------
def block_flops(m, tokens, recompute):
    """Forward FLOPs of one block for `tokens` tokens of whole sequences (Narayanan et al. 2021:
    24 t h^2 + 4 t s h; a mixture runs k MLPs of 16 t h^2 and a router of 2 t h E)."""
    h, s = m.hidden, m.seq_len
    mlp = 16 * tokens * h * h * (m.top_k if m.experts > 1 else 1) + (2 * tokens * h * m.experts if m.experts > 1 else 0)
    return 8 * tokens * h * h + 4 * tokens * s * h + mlp


def model_flops(m, batch, recompute="none"):
    """FLOPs of one optimizer step, all GPUs: 3 passes (forward, two for backward), 4 with full
    recomputation of the blocks; the head 3 passes of 2 t h V."""
    tokens = batch * m.seq_len
    passes = 4 if recompute == "full" else 3
    extra = 4 * tokens * m.seq_len * m.hidden * m.layers if recompute == "selective" else 0
    return passes * m.layers * block_flops(m, tokens, recompute) + extra + 3 * 2 * tokens * m.hidden * m.vocab


def link(g, hw, axis):
    """(alpha, beta) of an axis: inside a node when its group's span fits one (Megatron's order: tensor
    fastest, then context, data, pipeline), else InfiniBand."""
    stride = {"tensor": 1, "context": g.tp, "data": g.tp * g.cp, "expert": g.tp * g.cp, "pipeline": g.tp * g.cp * g.dp}
    size = {"tensor": g.tp, "context": g.cp, "data": g.dp, "expert": g.ep, "pipeline": g.pp}
    return hw.intra if stride[axis] * size[axis] <= hw.gpus_per_node else hw.inter


def collective_time(n, handed, calls, alpha, beta, kind):
    """Ring algorithms: an allreduce moves 2(n-1)/n of its vector in and out of each rank in 2(n-1)
    steps; a reduce-scatter, an all-gather and an all-to-all (n-1)/n in n-1 (data_parallel.py,
    sharded_data_parallel.py, context_parallel.py's docstrings)."""
    if n <= 1 or not handed:
        return 0.0
    factor = 2 if kind == "allreduce" else 1
    return calls * factor * (n - 1) * alpha + factor * (n - 1) / n * handed / beta


def step_time(m, g, batch, precision, recompute, hw, efficiency, optimizer):
    """Seconds per step on the slowest stage, by term."""
    rate = hw.rate(precision, g.gpus) * efficiency
    worst = None
    for stage in representative_stages(g.pp):
        lo, hi = layer_split(m.layers, g.pp)[stage]
        tokens = batch // g.dp * m.seq_len // g.cp           # this GPU's, all micro-batches
        passes = 4 if recompute == "full" else 3
        flops = passes * (hi - lo) * block_flops(m, tokens, recompute) / g.tp
        if recompute == "selective":
            flops += 4 * tokens * m.seq_len * m.hidden * (hi - lo) / g.tp
        if stage == g.pp - 1:
            flops += 3 * 2 * tokens * m.hidden * m.vocab / g.tp
        compute = flops / rate
        b = axis_bytes(m, g, batch, stage, precision)
        plain = axis_bytes(m, dataclasses.replace(g, sp=False), batch, stage, precision)  # what the wire carries
        a, beta = link(g, hw, "tensor")
        blocks = hi - lo
        tensor = collective_time(g.tp, plain["tensor"], g.micro * (4 * blocks + 2), a, beta, "allreduce")
        a, beta = link(g, hw, "context")
        context = collective_time(g.cp, b["context"], g.micro * blocks * 4, a, beta,
                                  "allgather" if g.cp_comm != "ring" else "ring") if g.cp > 1 else 0.0
        if g.cp > 1 and g.cp_comm == "ring":                 # (N-1) hops a pass, each alpha + block
            context = 3 * g.micro * blocks * (g.cp - 1) * a + b["context"] / beta
        a, beta = link(g, hw, "expert")
        expert = collective_time(g.ep, b["expert"], g.micro * blocks * 4, a, beta, "alltoall")
        a, beta = link(g, hw, "pipeline")
        messages = 2 * g.micro * (g.virtual if g.schedule == "interleaved" else 1)
        pipeline = (messages * a + b["pipeline"] / beta) if g.pp > 1 else 0.0
        per_step = compute + tensor + context + expert + pipeline
        stretched = per_step / (1 - bubble(g))               # the bubble stretches the whole pipeline
        a, beta = link(g, hw, "data")
        data = collective_time(g.dp * g.cp, b["data"], 1, a, beta, "allreduce" if not g.zero else "rs_ag")
        # What hides the data axis, as the files overlap it: plain data parallelism's buckets and stage 2's
        # reduce-scatters behind the last micro-batch's backward (stage 2's all-gather after the step is
        # exposed); stage 1 nothing (after backward); stage 3's prefetched gathers behind all the compute.
        backward = (compute / g.micro) * 2 / 3
        hidden = {0: backward, 1: 0.0, 2: min(backward, data / 2), 3: compute}[g.zero]
        exposed = max(0.0, data - hidden)
        params = sum(d + x for d, x in stage_layers(m, g, stage))
        state = params / (g.dp * g.cp if g.zero else 1)
        update = state * (28 if optimizer == "adam" else 20) / hw.hbm_bandwidth  # read and write the state
        total = stretched + exposed + update
        terms = {"compute": compute, "tensor": tensor, "context": context, "expert": expert,
                 "pipeline": pipeline, "bubble": stretched - per_step, "data_exposed": exposed,
                 "optimizer": update, "total": total}
        if worst is None or total > worst["total"]:
            worst = terms
    return worst


# -----------------------------------------------------------------------------
# One grid, every term; the search over grids
# -----------------------------------------------------------------------------
class PlanError(Exception):
    """An impossible grid or input: one line, exit status 2."""


def check_grid(m, g, batch, gpus):
    why = (f"tp={g.tp} does not divide --heads {m.heads}" if m.heads % g.tp
           else f"dp x tp x pp x cp = {g.gpus} GPUs, not the {gpus} given" if gpus and g.gpus != gpus
           else f"pp={g.pp} stages need at least {g.pp} --layers, got {m.layers}" if g.pp * g.virtual > m.layers
           else f"--batch-size {batch} does not split into dp={g.dp} replicas x micro={g.micro} micro-batches"
           if batch % (g.dp * g.micro) else
           f"cp={g.cp} does not divide --seq-len {m.seq_len}" if m.seq_len % (2 * g.cp if g.cp > 1 else 1)
           else f"cp_comm=alltoall needs cp={g.cp} to divide --heads {m.heads} / tp {g.tp}"
           if g.cp_comm == "alltoall" and (m.heads // g.tp) % g.cp else
           f"ep={g.ep} must divide --experts {m.experts} and dp={g.dp}" if m.experts % g.ep or g.dp % g.ep
           else f"zero={g.zero} must be 0, 1, 2 or 3" if g.zero not in (0, 1, 2, 3)
           else "ZeRO with a mixture of experts is not modelled; use zero=0" if g.zero and m.experts > 1
           else f"schedule {g.schedule} is not one of gpipe, 1f1b, interleaved, zb-h1, zbv"
           if g.schedule not in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv") else
           f"interleaved needs micro={g.micro} a multiple of pp={g.pp}" if g.schedule == "interleaved" and g.micro % g.pp
           else None)
    if why:
        raise PlanError(why)


def evaluate(m, g, batch, precision, recompute, hw, efficiency, optimizer, usable):
    busiest, total = grid_bytes(m, g, batch, precision)
    mem = max((memory(m, g, batch, precision, recompute, optimizer, s) for s in representative_stages(g.pp)),
              key=lambda d: d["total"])
    time = step_time(m, g, batch, precision, recompute, hw, efficiency, optimizer)
    flops = model_flops(m, batch, "none")
    hardware_flops = model_flops(m, batch, recompute)
    return {"grid": dataclasses.asdict(g), "fits": mem["total"] <= usable * hw.hbm,
            "memory_bytes_per_gpu": {k: round(v) for k, v in mem.items()},
            "bytes_per_step": busiest, "bytes_per_step_all_gpus": total,
            "bubble": bubble(g), "step_seconds": time["total"], "step_seconds_by_term": time,
            "tokens_per_second_per_gpu": batch * m.seq_len / time["total"] / g.gpus,
            "tflops_per_gpu": hardware_flops / time["total"] / g.gpus / 1e12,
            "mfu": flops / time["total"] / g.gpus / hw.rate(precision, g.gpus)}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(m, gpus, batch, hw, schedules=("1f1b",), hybrid=False):
    """Every grid worth trying: tp within a node dividing the heads, pp dividing the GPUs left, cp
    a power of two, ep dividing the experts, ZeRO 0-3, micro-batches of 1, 2, 4 or 8 sequences."""
    for tp in (t for t in divisors(gpus) if m.heads % t == 0 and t <= hw.gpus_per_node):
        for cp in (c for c in divisors(gpus // tp) if c == 1 or not hybrid and c & (c - 1) == 0 and m.seq_len % (2 * c) == 0):
            for pp in (p for p in divisors(gpus // (tp * cp)) if p <= m.layers):
                dp = gpus // (tp * cp * pp)
                if batch % dp:
                    continue
                share = batch // dp
                for ep in (e for e in divisors(dp) if m.experts % e == 0) if m.experts > 1 else (1,):
                    for zero in ((0, 1, 2, 3) if dp * cp > 1 and m.experts == 1 and not hybrid else (0,)):
                        for size in (z for z in (1, 2, 4, 8) if share % z == 0):
                            for schedule in (schedules if pp > 1 else ("1f1b",)):
                                yield Grid(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro=share // size,
                                           schedule=schedule, sp=tp > 1 and not hybrid)


def peak_memory(m, g, batch, precision, recompute, optimizer):
    return max(memory(m, g, batch, precision, recompute, optimizer, s)["total"] for s in representative_stages(g.pp))


def search(m, gpus, batch, precision, recompute, hw, efficiency, optimizer, usable, top, hybrid=False):
    """The grids that fit, fastest first: memory and time on every candidate, every term on the best."""
    tried = list(candidates(m, gpus, batch, hw, hybrid=hybrid))
    fits = [g for g in tried if peak_memory(m, g, batch, precision, recompute, optimizer) <= usable * hw.hbm]
    timed = sorted(fits, key=lambda g: step_time(m, g, batch, precision, recompute, hw, efficiency, optimizer)["total"])
    return [evaluate(m, g, batch, precision, recompute, hw, efficiency, optimizer, usable) for g in timed[:top]], tried


def gpus_needed(m, batch, precision, recompute, hw, optimizer, usable, hybrid=False):
    """The fewest GPUs (whole nodes, batch permitting) on which some grid fits memory."""
    n = hw.gpus_per_node if hw.gpus_per_node < 1 << 20 else 1
    while n <= 1 << 20:
        for g in candidates(m, n, batch, hw, hybrid=hybrid):
            if peak_memory(m, g, batch, precision, recompute, optimizer) <= usable * hw.hbm:
                return n
        n *= 2
    return None


# -----------------------------------------------------------------------------
# The command line
# -----------------------------------------------------------------------------
def parse_grid(text):
    keys = {f.name for f in dataclasses.fields(Grid)}
    values = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in keys or not value:
            raise PlanError(f"--grid takes key=value pairs of {', '.join(sorted(keys))}; got {item!r}")
        if key in ("schedule", "cp_comm"):
            values[key] = value
        elif key == "sp":
            values[key] = value.lower() in ("1", "true", "yes")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise PlanError(f"--grid {key}={value}: not a whole number") from None
            if values[key] < (0 if key == "zero" else 1):
                raise PlanError(f"--grid {key}={value} must be {'0 or more' if key == 'zero' else 'positive'}")
    return Grid(**values)


def grid_of_run(result):
    """The grid a strategy file ran on, from its --json."""
    n, name = result["world_size"], result["strategy"]
    if name == "hybrid_parallel":
        return Grid(dp=result["grid"]["dp"], tp=result["grid"]["tp"], pp=result["grid"]["pp"],
                    micro=result["micro_batches"])
    return {"tensor_parallel": Grid(tp=n, sp=bool(result.get("sequence_parallel"))),
            "pipeline_parallel": Grid(pp=n, micro=result.get("micro_batches", 1), schedule=result.get("schedule", "1f1b"),
                                      virtual=result.get("virtual_stages", 1)),
            "sharded_data_parallel": Grid(dp=n, zero=result.get("zero_stage", 0)),
            "context_parallel": Grid(cp=n, cp_comm=result.get("cp_comm", "ring")),
            "expert_parallel": Grid(dp=n, ep=result.get("ep", 1))}.get(name, Grid(dp=n))


def calibrate(m, g, batch, result, precision, recompute, optimizer, cores=None):
    """FLOP/s per core at which plan.py's step on the run's grid takes the run's measured step_time_s
    (a strategy file's --json, launched with this model and batch): the communication terms stay as
    modelled, the compute takes the rest. Its ranks share the cores (cpu_hardware)."""
    rate = model_flops(m, batch, recompute) / result["step_time_s"] / min(cores or machine_cores(), g.gpus)
    for _ in range(30):   # the compute is work / rate, the rest hardly moves with the rate: a fixed point
        t = step_time(m, g, batch, precision, recompute, cpu_hardware(rate, cores), 1.0, optimizer)
        rate *= t["total"] / result["step_time_s"]
    return rate


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not argparse's usage and message
        raise PlanError(message)


def parse_args(argv):
    p = Parser(description="Which grid? Memory and step time per GPU for a GPT on a cluster.")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--vocab", type=int, default=128, help="vocabulary (the files: 128 ASCII codes)")
    p.add_argument("--experts", type=int, default=1, help="experts per block (1: a dense MLP)")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--batch-size", type=int, required=True, help="global batch, in sequences")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="adam: 8 bytes of state a parameter; sgd: momentum, 4 (the files' SGD)")
    p.add_argument("--gpus", type=int, help="GPUs in all (default: the grid's, with --grid)")
    p.add_argument("--gpu", default="h100", help="a100, h100, h200, or cpu (with --flops or --calibrate)")
    p.add_argument("--gpus-per-node", type=int, help="override the preset's 8")
    p.add_argument("--efficiency", type=float, default=0.6,
                   help="fraction of peak FLOP/s the matrix products reach (an assumption: state yours)")
    p.add_argument("--usable", type=float, default=0.9, help="fraction of HBM a plan may fill")
    p.add_argument("--flops", type=float, help="--gpu cpu: FLOP/s of one core (what --calibrate finds)")
    p.add_argument("--calibrate", metavar="JSON", help="--gpu cpu: a strategy file's --json output, run with this "
                   "model and --batch-size (its FLOP/s per core are solved for)")
    p.add_argument("--grid", help="one grid: dp=..,tp=..,pp=..,cp=..,ep=..,zero=..,micro=..,schedule=..,sp=..")
    p.add_argument("--top", type=int, default=10, help="grids to print")
    p.add_argument("--hybrid", action="store_true", help="only grids hybrid_parallel.py runs: dp x tp x pp, 1F1B, "
                   "no ZeRO, context, expert or sequence parallelism")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    return p.parse_args(argv)


def hardware(args, m):
    if args.gpu == "cpu":
        flops = args.flops
        if args.calibrate:
            with open(args.calibrate) as f:
                result = json.loads(f.read().strip().splitlines()[-1])
            flops = calibrate(m, grid_of_run(result), args.batch_size, result, args.precision, args.recompute,
                              args.optimizer)
        if not flops:
            raise PlanError("--gpu cpu needs --flops X or --calibrate RUN.json (a strategy file's --json output)")
        return cpu_hardware(flops), 1.0
    if args.gpu not in PRESETS:
        raise PlanError(f"--gpu {args.gpu}: use one of {', '.join(PRESETS)} or cpu")
    hw = PRESETS[args.gpu]
    if args.gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    return hw, args.efficiency


def describe(p):
    g = p["grid"]
    parts = [f"dp={g['dp']}", f"tp={g['tp']}", f"pp={g['pp']}", f"cp={g['cp']}"]
    parts += [f"ep={g['ep']}"] if g["ep"] > 1 else []
    parts += [f"zero={g['zero']}", f"micro={g['micro']}"]
    parts += [f"schedule={g['schedule']}"] if g["pp"] > 1 else []
    parts += ["sp=1"] if g["sp"] else []
    return ",".join(parts)


def print_plans(args, m, hw, plans, efficiency):
    first = plans[0]["grid"]
    print(f"{first['dp'] * first['tp'] * first['pp'] * first['cp']} x {hw.name} | compute at {efficiency:.0%} of "
          f"{hw.peak[args.precision] / 1e12:g} TFLOP/s {args.precision} | {args.precision}, recompute {args.recompute}, "
          f"{args.optimizer}")
    params = sum(d + x for d, x in stage_layers(m, Grid(), 0))
    print(f"model: {m.layers} blocks x {m.hidden} hidden, {m.heads} heads, seq {m.seq_len}, vocab {m.vocab}"
          + (f", {m.experts} experts top-{m.top_k}" if m.experts > 1 else "") + f": {params / 1e9:.2f} B parameters")
    print(f"{'grid':52} {'GB/GPU':>7} {'weights':>7} {'grads':>6} {'optim':>6} {'acts':>6} {'bubble':>6} "
          f"{'step s':>8} {'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>5}  GB/step per GPU: data tensor pipeline context expert")
    for p in plans:
        mb = p["memory_bytes_per_gpu"]
        b = p["bytes_per_step"]
        print(f"{describe(p):52} {mb['total'] / 1e9:7.1f} {mb['weights'] / 1e9:7.1f} {mb['gradients'] / 1e9:6.1f} "
              f"{mb['optimizer'] / 1e9:6.1f} {mb['activations'] / 1e9:6.1f} {p['bubble']:6.1%} "
              f"{p['step_seconds']:8.3f} {p['tokens_per_second_per_gpu']:9.0f} {p['tflops_per_gpu']:7.1f} {p['mfu']:5.1%}  "
              + " ".join(f"{b[a] / 1e9:.2f}" for a in ("data", "tensor", "pipeline", "context", "expert"))
              + ("" if p["fits"] else "  (does not fit)"))
    g, per_node = plans[0]["grid"], min(hw.gpus_per_node, plans[0]["grid"]["dp"] * plans[0]["grid"]["tp"] * plans[0]["grid"]["pp"] * plans[0]["grid"]["cp"])
    if hw.cores:
        return
    gpus = g["dp"] * g["tp"] * g["pp"] * g["cp"]
    print(f"best as a batch script ({describe(plans[0])}):")
    print(f"  #SBATCH --nodes={-(-gpus // per_node)} --ntasks-per-node={per_node} --gpus-per-node={per_node} "
          f"--distribution=block:block")
    missing = [what for what, on in (("mixture of experts", m.experts > 1), (f"ZeRO stage {g['zero']}", g["zero"] > 1),
                                     (f"the {g['schedule']} schedule", g["pp"] > 1 and g["schedule"] != "1f1b")) if on]
    print(f"  srun python hybrid_parallel.py --pp {g['pp']} --dp {g['dp']} --tp {g['tp']} --micro-batches {g['micro']} "
          f"--layers {m.layers} --hidden {m.hidden} --heads {m.heads} --seq-len {m.seq_len} --batch-size {args.batch_size} "
          + (f"--cp {g['cp']} " if g["cp"] > 1 else "") + ("--zero-stage 1 " if g["zero"] == 1 else "")
          + ("--sequence-parallel " if g["sp"] else "") + f"--precision {args.precision} --recompute {args.recompute} --no-check")
    if missing:
        print(f"  (hybrid_parallel.py does not offer {', '.join(missing)} yet: this line trains without it, "
              f"while the plan's figures assume it)")


def main(argv=None):
    try:
        args = parse_args(argv)
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "experts", "top_k", "batch_size"):
            if getattr(args, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
        if args.hidden % args.heads:
            raise PlanError(f"--hidden {args.hidden} does not split into {args.heads} heads")
        m = Model(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, args.experts, args.top_k)
        hw, efficiency = hardware(args, m)
        if args.grid:
            g = parse_grid(args.grid)
            check_grid(m, g, args.batch_size, args.gpus)
            plans = [evaluate(m, g, args.batch_size, args.precision, args.recompute, hw, efficiency,
                              args.optimizer, args.usable)]
        else:
            if not args.gpus:
                raise PlanError("give --gpus N to search the grids, or --grid to evaluate one")
            plans, tried = search(m, args.gpus, args.batch_size, args.precision, args.recompute, hw, efficiency,
                                  args.optimizer, args.usable, args.top, args.hybrid)
            if not tried:
                raise PlanError(f"no grid of {args.gpus} GPUs splits --batch-size {args.batch_size} and --heads "
                                f"{args.heads}; try a batch that {args.gpus} divides")
            if not plans:
                need = gpus_needed(m, args.batch_size, args.precision, args.recompute, hw, args.optimizer, args.usable,
                                   args.hybrid)
                least = min(tried, key=lambda g: peak_memory(m, g, args.batch_size, args.precision, args.recompute,
                                                             args.optimizer))
                least = evaluate(m, least, args.batch_size, args.precision, args.recompute, hw, efficiency,
                                 args.optimizer, args.usable)
                raise PlanError(f"no grid of {args.gpus} {args.gpu} GPUs fits: the least memory, "
                                f"{describe(least)}, needs {least['memory_bytes_per_gpu']['total'] / 1e9:.1f} GB a GPU of "
                                f"{args.usable * hw.hbm / 1e9:.1f} usable; "
                                + (f"it would need {need} GPUs" if need else "no number of GPUs fits it")
                                + (" (or --recompute full)" if args.recompute != "full" else ""))
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"plans": plans}))
    else:
        print_plans(args, m, hw, plans, efficiency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
