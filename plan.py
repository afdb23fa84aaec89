"""Which grid? Memory and step time per GPU for a GPT on any grid of data, tensor, pipeline, context
and expert parallelism, from the formulas the strategy files state and measure.

    python plan.py --layers 80 --hidden 8192 --heads 64 --seq-len 4096 --vocab 128256 \
                   --batch-size 512 --gpus 256 --gpu h200                  # the grids that fit, best first
    python plan.py ... --grid dp=4,tp=8,pp=8,micro=32                      # one grid, every term
    python plan.py ... --json                                              # inputs, assumptions, plans: one line
    python plan.py --published                                             # the step-time model against published runs

What it adds up, per GPU and per optimizer step (B sequences of s tokens, L blocks, hidden h, a heads
of which kv carry keys and values, an MLP f wide, vocabulary V; a grid of dp x tp x pp x cp GPUs, ep of
the dp x cp ranks sharing the experts out):

  memory     weights, gradients, optimizer state (ZeRO stage 0-3 over the dp x cp ranks) and the
             activations that the pipeline schedule keeps alive, by --precision, --recompute, --attention
  bytes      handed to the network on each axis (data, tensor, pipeline, context, expert)
  bubble     the pipeline schedule's idle share of the step
  time       on a GPU: the matrix products' FLOPs at a share of peak, the other kernels as passes over
             the bytes a block keeps at the memory's bandwidth (so eager attention's s^2 scores weigh on
             small hidden sizes), FlashAttention at the share of peak its authors measured, and the
             communication not hidden, each exchange alpha + bytes / beta on its link (NVLink inside a
             node, InfiniBand across) as an NCCL-class library moves it, the bubble stretching the rest.
             The two constants are fitted to published runs (published_runs(), below; --published prints
             each run predicted by constants fitted to the others). --efficiency X instead: every FLOP
             at X of peak. On the CPU (--gpu cpu): FLOP/s per core calibrated from a run of the files.

GPU times assume NCCL-class collectives (NCCL, RCCL): ring and tree algorithms on NVLink and InfiniBand
at the links' bandwidth, bf16 sums of activations. The strategy files exchange through MPI, host-staged
unless the library is CUDA-aware, and sum in float32: run on GPUs, they are slower than these times.

Where each formula comes from (every one of them is stated in that file's docstring and measured by
that file's run; tests/test_plan.py holds plan.py's bytes to those measurements, exactly, and its
memory to their measured peaks):

  parameters      hybrid_parallel.py, docstring "Communication per step", data: W, the parameters of a
                  replica, the vocabulary padded to a multiple of tp, plus (tp - 1) x (sh + 6Lh + 2h) held
                  whole on every tensor-parallel rank; sharded_data_parallel.py's GPT drops the key bias.
                  --kv-heads: k and v of kv x h/a columns (grouped-query attention); --ffn-hidden f: the MLP
                  a SwiGLU of three h x f matrices without biases (Llama's), for the MLP's 8h^2 + 5h
  tensor axis     tensor_parallel.py, docstring "Communication per step": (4L + 2) x A + 12 bs bytes handed
                  to MPI, A = 4bsh: sums in float32 whatever the precision; sequence parallel: reduce-
                  scatters hand in A, all-gathers eA/4t (the embedding's backward one A/t), plus one allreduce
                  of the 4(6L + 2 + s)h bytes of replicated gradients; hybrid_parallel.py: per stage, and
                  --recompute full's 2L more (F)
  pipeline axis   pipeline_parallel.py, docstring "Communication per step": 2K x B x s x h x e bytes in 2MK
                  messages, K stage boundaries (P - 1; PV - 1 interleaved; 2P - 2 for zbv)
  data axis       data_parallel.py, "Communication per step": one allreduce of G = 4 bytes x parameters;
                  sharded_data_parallel.py, "Communication per step": ZeRO 1 and 2 hand 2 x G, stage 3 3 x G
                  (bf16: 1.5 G and 2 G, the all-gathers in bf16), each layer's flat vector padded to a multiple
                  of the ranks; hybrid_parallel.py's ZeRO-1: 4W'(1 + 1/n), W' padded bucket by bucket
  context axis    context_parallel.py, "Bytes handed to MPI per step and rank", S = b(s/N)h values: ring
                  L x 2S x ((2+R)e(N-1) + 4N), all-gather L x 2S x ((2+R)e + 4N), all-to-all L x 4S x (2+R)e,
                  R = 1 when recomputation reruns the exchange; + 8 (the loss, float64)
  expert axis     expert_parallel.py, "Communication per step": 4 L k n h x bytes by Alltoallv, L E 8 for the
                  counts and L E 8 for the router's counts, with full recomputation 6 and twice; dense
                  gradients over all data ranks, expert gradients over the dp / ep copies of each expert
  bubble          pipeline_parallel.py, docstring "The bubble": (P-1)/(M+P-1) gpipe and 1f1b, (P-1)/(VM+P-1)
                  interleaved, 1 - 3M/(2M+P-1+max(M,P)) zb-h1, (P-1)/(6M+P-1) zbv
  memory          sharded_data_parallel.py, "Memory per rank" (ZeRO, and Megatron's and FSDP's bf16): float32
                  4 + 4 + 8 bytes a parameter, stage 1 8Psi + 8Psi/N, stage 2 4Psi + 12Psi/N + W, stage 3
                  16Psi/N + 2W; bf16 (bf16 weights, float32 masters apart) 18Psi, 6Psi + 12Psi/N, 2Psi +
                  16Psi/N + W, 16Psi/N + 1.5W (W: 4 bytes x the largest two neighbouring layers);
                  hybrid_parallel.py, "Memory per rank" (--hybrid): weights, gradients, momentum 4W_r each,
                  ZeRO-1 momentum 4W_r'/n, and as its code holds them: in bf16 autocast's bf16 copy of the
                  weights for each micro-batch in flight, under ZeRO-1 the gradients' and the parameters'
                  float32 slices, the gradient buckets' flat copies while they are exchanged;
                  pipeline_parallel.py, "Peak memory": micro-batches held, min(M, P) for 1f1b on the first
                  stage
  activations     hybrid_parallel.py, "Memory per rank" (tensor_parallel.py's "Activations saved for
                  backward" on a grid): per block bsh(8/c + 2e + 12e/t) + 16bs/c + Y, c = t with sequence
                  parallelism, Y = (4, bf16 6)abs^2/t + s^2 (the float32 softmax, its bf16 copy, the mask),
                  at cp > 1 ebsh/t + 4abs/t; selective without Y; full 4bsh/c, the float32 input; once 9bs +
                  8s/c first, bsh(4/c + e) + 8bs/c + 4bsV/t + 9bs last. sharded_data_parallel.py's GPT in bf16:
                  40bsh, q, k and v each casting their input. --kv-heads, --ffn-hidden: q, k, v and the
                  output (2 + 2kv/a) and the MLP's 8h (SwiGLU: 4f) in the 12e/t. --attention flash (what a GPU
                  framework keeps): no s^2 scores, the log-sum-exp 4abs/t instead; eager: the files' Y
  FLOPs           Narayanan et al. 2021, eq. 3: 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with full recompute;
                  72 B s L h^2 (1 + s/(6h) + V/(12 L h)) without; MFU counts the model's 72-formula FLOPs;
                  --kv-heads and --ffn-hidden change the matrices' 24h^2 to 2(2h^2 + 2h kv h/a + 3hf)

What it does not model: overlap beyond what --overlap says (files: the data axis hides behind the last
micro-batch's backward, tensor and context exchanges are exposed, pipeline sends cost alpha + bytes/beta
per micro-batch and boundary; full: Megatron-Core's), memory fragmentation and the libraries' own
memory (a grid fits when its total is within --usable of HBM), and the kernels' tiles, waves and clocks:
the step-time model is a fit, not a simulation.
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import textwrap

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
# 10 us across (the order NCCL's small messages take); the bandwidths are the datasheets' (a share of them,
# fitted, went to 1: see docs/plan.md). FlashAttention's share of peak, forward and backward: Dao 2023,
# "FlashAttention-2" (arXiv:2307.08691), 50% to 73% of an A100's (0.5 here), up to 335 TFLOP/s on an H100
# (0.34; FlashAttention-3 and cuDNN's reach more: state yours with a new preset).
@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: its peak is a dict
class Hardware:
    name: str
    peak: dict           # FLOP/s by precision, dense
    hbm: float           # bytes of memory per GPU
    hbm_bandwidth: float
    gpus_per_node: int
    intra: tuple         # (alpha s, beta bytes/s one way) inside a node
    inter: tuple         # the same across nodes, per GPU (one NIC each)
    cores: int = 0       # a CPU: its ranks share these cores (peak is then FLOP/s per core); 0 for GPUs
    flash: float = 0.5   # FlashAttention's share of peak, forward and backward (causal: its FLOPs half the counted)

    def rate(self, precision, ranks):
        """FLOP/s of one rank: a GPU's peak; on a CPU, its share of the cores (the files give each of
        N ranks cores // N threads, and ranks beyond the cores take turns)."""
        if not self.cores:
            return self.peak[precision]
        return self.peak[precision] * (self.cores // ranks if ranks <= self.cores else self.cores / ranks)


GiB = 2 ** 30
PRESETS = {
    "a100": Hardware("A100 SXM 80GB, 8 a node (DGX A100)", {"bf16": 312e12, "fp32": 19.5e12}, 80 * GiB,
                     2.039e12, 8, (5e-6, 300e9), (10e-6, 25e9), flash=0.5),
    "h100": Hardware("H100 SXM 80GB, 8 a node (DGX H100)", {"bf16": 989e12, "fp32": 67e12}, 80 * GiB,
                     3.35e12, 8, (5e-6, 450e9), (10e-6, 50e9), flash=0.34),
    "h200": Hardware("H200 SXM 141GB, 8 a node (DGX H200)", {"bf16": 989e12, "fp32": 67e12}, 141e9,
                     4.8e12, 8, (5e-6, 450e9), (10e-6, 50e9), flash=0.34),
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
# The model, the grid, how it trains, and the GPT's parameters on each GPU
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
    key_bias: bool = True     # False: sharded_data_parallel.py's GPT: q, k, v three Linears, the key without bias
    kv_heads: int = 0         # grouped-query attention: k and v for this many heads (0: every head its own)
    ffn_hidden: int = 0       # 0: the files' GELU MLP, 4h wide; f > 0: a SwiGLU f wide, three matrices, no biases

    @property
    def kv_width(self):
        return self.kv_heads * (self.hidden // self.heads) if self.kv_heads else self.hidden

    @property
    def ffn(self):
        return self.ffn_hidden or 4 * self.hidden


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


@dataclasses.dataclass(frozen=True)
class Training:
    """How the step runs, beyond the grid."""
    precision: str = "bf16"
    recompute: str = "none"        # none, selective (attention's core), full (each block from its input)
    attention: str = "flash"       # flash: no s^2 scores kept (FlashAttention); eager: the files' softmax, kept
    optimizer: str = "adam"        # adam: 8 bytes of state a parameter; sgd: momentum, 4
    weights: str = "master"        # bf16 weights with float32 masters apart (sharded_data_parallel.py, Megatron,
    #                                FSDP), or "autocast": float32 weights, autocast's bf16 copies (hybrid_parallel.py)
    overlap: str = "files"         # what hides behind compute: "files" (as the files overlap, below), "none"
    #                                (every exchange exposed: Megatron's local DDP of 2021), "full" (Megatron-Core's
    #                                --overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap)
    scatter_gather: bool = False   # pipeline sends of 1/tp, all-gathered in the node (Narayanan et al. 2021)
    kernels: str = "fused"         # the kernels besides matrix products: fused (Megatron, torch.compile) or eager

    @property
    def element(self):
        """Bytes of an activation saved or moved: Megatron's 2 in bf16, 4 in fp32."""
        return 2 if self.precision == "bf16" else 4


def layer_split(layers, stages):
    """Blocks [lo, hi) of each stage: the extra blocks to the first stages (pipeline_parallel.py's split)."""
    sizes = [layers // stages + (s < layers % stages) for s in range(stages)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(stages)]


def padded_vocab(vocab, tp):
    return -(-vocab // tp) * tp


def mlp_parameters(m, t):
    """One MLP on one tensor-parallel rank: (split, whole). GELU: fc1 and fc2, 8h^2 + 4h split, fc2's bias
    whole; SwiGLU: three h x f matrices, no biases."""
    h = m.hidden
    return ((3 * h * m.ffn_hidden) // t, 0) if m.ffn_hidden else ((8 * h * h + 4 * h) // t, h)


def stage_layers(m, g, stage):
    """The flat layers one GPU of `stage` holds, as ZeRO flattens them (sharded_data_parallel.py: the
    embeddings, each block, the final norm with the head), in parameters: (dense, expert) for each.
    Column-parallel weights and biases and the vocabulary are split over tp; LayerNorms, positions and
    row-parallel biases are whole on every tensor-parallel rank (hybrid_parallel.py's W)."""
    h, t, (lo, hi) = m.hidden, g.tp, layer_split(m.layers, g.pp)[stage]
    v, kv = padded_vocab(m.vocab, t), m.kv_width
    qkv_bias = h + kv + (kv if m.key_bias else 0)
    attention = (2 * h * h + 2 * h * kv + qkv_bias) // t + h + 2 * h   # q, k, v, proj (bias whole), ln1
    split, whole = mlp_parameters(m, t)
    if m.experts > 1:   # ln2 and the router whole; E/ep experts
        block = [(attention + 2 * h + h * m.experts, m.experts // g.ep * (split + whole)) for _ in range(lo, hi)]
    else:
        block = [(attention + split + whole + 2 * h, 0) for _ in range(lo, hi)]
    first = [(v * h // t + m.seq_len * h, 0)] if stage == 0 else []
    last = [(2 * h + v * h // t, 0)] if stage == g.pp - 1 else []
    return first + block + last


def parameter_count(m):
    return sum(d + x for d, x in stage_layers(m, Grid(), 0))


# -----------------------------------------------------------------------------
# Bytes per step on each axis: what one GPU hands to the network (the files' count, at the MPI calls)
# -----------------------------------------------------------------------------
def replicated_per_block(m):
    """Parameters of a block whole on every tensor-parallel rank: two LayerNorms, proj's bias, fc2's
    (a SwiGLU has none); with experts the router instead of fc2's bias."""
    h = m.hidden
    return 5 * h + (m.experts * h if m.experts > 1 else 0 if m.ffn_hidden else h)


def hybrid_zero_padded(params, n, bucket_bytes=25e6):
    """hybrid_parallel.py's ZeRO-1 pads each gradient bucket (--bucket-mb, 25 MB) to a multiple of the n
    ranks: the stage's parameters in buckets of at most that many float32 values, each padded."""
    per = max(1, int(bucket_bytes // 4))
    buckets = [per] * (params // per) + ([params % per] if params % per else [])
    return sum(-(-b // n) * n for b in buckets)


def axis_bytes(m, g, tr, batch, stage):
    """Bytes one GPU of `stage` hands to MPI per step on each axis (the same on every GPU of a stage,
    the expert axis on average). Sums are float32 whatever the precision; what only moves is e bytes."""
    e, h, s, t = tr.element, m.hidden, m.seq_len, g.tp
    lo, hi = layer_split(m.layers, g.pp)[stage]
    blocks, first, last = hi - lo, stage == 0, stage == g.pp - 1
    share = batch // g.dp                     # sequences of this replica, all micro-batches together
    tokens = share * s // g.cp                # tokens this GPU computes per step
    A = 4 * tokens * h                        # one float32 activation of all micro-batches together
    again = 2 * blocks if tr.recompute == "full" else 0     # F: the blocks' forward exchanges again
    out = {"data": 0, "tensor": 0, "pipeline": 0, "context": 0, "expert": 0}
    layers = stage_layers(m, g, stage)
    dense, expert = sum(d for d, _ in layers), sum(x for _, x in layers)
    n = g.dp * g.cp
    if n > 1:                                 # gradients: over every rank that saw other data
        if g.zero and tr.weights == "autocast":   # hybrid_parallel.py: reduce-scatter, then all-gather a slice
            padded = hybrid_zero_padded(dense + expert, n)
            out["data"] = 4 * padded + 4 * padded // n
        elif g.zero:
            padded = sum(-(-(d + x) // n) * n for d, x in layers)
            # stage 3 gathers each layer before its forward and its backward and reduce-scatters its
            # gradient, once per micro-batch (the file's step is one micro-batch); the gathers move e bytes
            gathers = 1 if g.zero < 3 else 2
            out["data"] = (4 * padded + gathers * e * padded) * (1 if g.zero < 3 else g.micro) + 4  # + the norm
        else:
            out["data"] = 4 * dense + (4 * expert if n // g.ep > 1 else 0)
    if t > 1:
        sums = 4 * blocks + first + last + again  # f and f-bar: 2 a block forward, 2 backward, embedding, head
        loss = 3 * 4 * tokens if last else 0
        if g.sp:
            replicated = replicated_per_block(m) * blocks + (s * h if first else 0) + (2 * h if last else 0)
            gathers = (4 * blocks + last + again) * e * tokens * h // t + (A // t if first else 0)
            out["tensor"] = sums * A + gathers + loss + 4 * replicated
        else:
            out["tensor"] = sums * A + loss
    if g.pp > 1:   # sends only, each micro-batch's activation or its gradient: forward unless the last
        # chunk of the model, backward unless the first (zbv: a rank's two chunks meet on the last rank)
        sends = ((2 if first or last else 4) if g.schedule == "zbv"
                 else 2 * g.virtual - first - last if g.schedule == "interleaved" else (not last) + (not first))
        out["pipeline"] = sends * e * tokens * h // (t if tr.scatter_gather else 1)
    if g.cp > 1:
        S, N, R = tokens * h // t, g.cp, tr.recompute != "none"   # one rank's K of one layer, in values
        per_layer = {"ring": 2 * S * ((2 + R) * e * (N - 1) + 4 * N), "allgather": 2 * S * ((2 + R) * e + 4 * N),
                     "alltoall": 4 * S * (2 + R) * e}[g.cp_comm]
        out["context"] = blocks * per_layer + 8
    if m.experts > 1 and g.ep > 1:   # full: the forward's dispatch, combine and counts again in backward
        full = tr.recompute == "full"
        out["expert"] = (4 + 2 * full) * blocks * m.top_k * tokens * h * e + 2 * (1 + full) * blocks * m.experts * 8
    return out


def representative_stages(pp):
    """The stages that can be the busiest: the first (embeddings, the most blocks, the most micro-batches
    in flight), the second (the most of the middle ones: extra blocks go to the first stages), the last
    (the head and the loss). Every other stage holds no more and computes no more than the second."""
    return sorted({0, min(1, pp - 1), pp - 1})


def grid_bytes(m, g, tr, batch):
    """Per step: the busiest GPU's bytes on each axis, and the sum over every GPU of the grid."""
    stages = [axis_bytes(m, g, tr, batch, s) for s in range(g.pp)]
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


def block_activations(m, g, tr, sequences, recompute=None):
    """Bytes one block saves for backward for `sequences` sequences of one micro-batch on one GPU
    (hybrid_parallel.py's "Memory per rank"): float32 the LayerNorms' inputs and statistics (8bsh + 16bs,
    cut by t with sequence parallelism), the inputs of qkv and fc1 (2e bsh: bf16 copies, or the float32
    LayerNorm output; sharded_data_parallel.py's separate q, k, v cast theirs three times), q, k, v and
    attention's output, fc1's output and GELU's (12e bsh/t); the scores Y. Selective recomputation drops
    the scores; full keeps the block's float32 input alone. A mixture keeps k copies of the MLP's."""
    recompute = recompute or tr.recompute
    e, h, t, a = tr.element, m.hidden, g.tp, m.heads
    n = m.seq_len // g.cp
    bsh, bs, cut = sequences * n * h, sequences * n, t if g.sp else 1
    if recompute == "full":
        return 4 * bsh / cut
    casts = 4 if tr.precision == "bf16" and not m.key_bias else 2
    attention = 2 + 2 * m.kv_width / h                  # q, k, v, the core's output
    mlp = 4 * m.ffn / h if m.ffn_hidden else 8           # SwiGLU: gate and up, silu, their product; GELU: 4 + 4
    if m.experts > 1:
        mlp += (1 + mlp) * (m.top_k - 1)                # each further choice: fc1's input, and its outputs
    per = (8 * bsh + 16 * bs) / cut + casts * e * bsh + e * bsh * (attention + mlp) / t
    if recompute == "none":
        if g.cp > 1:                                    # the ring's merged output and log-sum-exp
            per += (e * bsh + 4 * a * bs) / t
        elif tr.attention == "flash":                   # FlashAttention: the log-sum-exp, no scores
            per += 4 * a * bs / t
        else:                                           # the float32 softmax (and its bf16 copy), the mask
            per += (4 if e == 4 else 6) * a * sequences * n * n / t + n * n
    return per


def stage_activations(m, g, tr, batch, stage):
    """Bytes of activations on one GPU of `stage` at the peak: the blocks of every micro-batch in flight,
    the embedding's indices and the head's inputs and float32 logits, one block's whole during its
    recomputation under full."""
    lo, hi = layer_split(m.layers, g.pp)[stage]
    b, n, t = batch // g.dp // g.micro, m.seq_len // g.cp, g.tp
    cut, e, h = t if g.sp else 1, tr.element, m.hidden
    held = in_flight(g, stage)
    acts = held * (hi - lo) * block_activations(m, g, tr, b)
    if tr.recompute == "full":
        acts += block_activations(m, g, tr, b, "none")
    sharded = not m.key_bias                  # sharded_data_parallel.py's indices, loss and targets: 8bs, 16bs + 4
    if stage == 0:
        acts += held * ((8 if sharded else 9) * b * n + 8 * n / cut)
    if stage == g.pp - 1:
        acts += held * ((4 * b * n * h + 8 * b * n) / cut + e * b * n * h + 4 * b * n * padded_vocab(m.vocab, t) / t
                        + (8 * b * n + 4 if sharded else 9 * b * n))
    return acts


def memory(m, g, tr, batch, stage):
    """Bytes on one GPU of `stage` at the peak of a step, by kind: weights, gradients and optimizer state
    (what persists from step to step), buffers (what the step holds for a while besides: gathered layers,
    whole gradients, the copies an exchange sends), activations."""
    layers = stage_layers(m, g, stage)
    sizes = [d + x for d, x in layers]
    n = g.dp * g.cp                           # ZeRO shards over every rank that holds the same weights
    state = 8 if tr.optimizer == "adam" else 4
    bf16 = tr.precision == "bf16"
    if tr.weights == "autocast":              # hybrid_parallel.py, "Memory per rank", and its code
        psi = sum(sizes)
        copies = 0                            # autocast's bf16 copy of the weights, saved by each micro-batch
        if bf16:                              # in flight (with full recomputation, one layer's at a time)
            copies = 2 * (psi * in_flight(g, stage) if tr.recompute != "full" else max(sizes))
        out = {"weights": 4 * psi + copies, "gradients": 4 * psi, "optimizer": state * psi, "buffers": 0}
        if n > 1:                             # GradBuckets: each bucket's flat copy, sent and held until the end
            bucket = min(4 * psi, 25e6)       # of backward, and one bucket's more (its / N; ZeRO-1: its padding)
            if g.zero:                        # ShardedOptimizer: the reduce-scattered slice of the gradients, the
                padded = hybrid_zero_padded(psi, n)   # parameters' float32 slice that SGD steps, its momentum
                out["gradients"] += 4 * padded / n
                out["optimizer"] = (4 + state) * padded / n
                out["buffers"] = 4 * padded + bucket
            else:
                out["buffers"] = 4 * psi + bucket
    else:                                     # sharded_data_parallel.py's "Memory per rank" and memory_formula()
        psi = sum(-(-p // n) * n for p in sizes) if g.zero else sum(sizes)
        pair = 4 * max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0])  # W: two neighbours
        shard = psi / n if g.zero else psi
        if g.zero == 3:                       # its partition of the float32 masters
            weights = 4 * shard
        else:                                 # whole (bf16 whole, and float32 masters sharded from stage 1)
            weights = (2 * psi + 4 * shard) if bf16 else 4 * psi
        out = {"weights": weights, "gradients": 4 * psi if g.zero < 2 else 4 * shard, "optimizer": state * shard,
               # stage 3 gathers two neighbouring layers (bf16: W / 2); stages 2 and 3 hold two whole gradients
               "buffers": (pair / 2 if bf16 else pair) * (g.zero == 3) + pair * (g.zero >= 2)}
    out["activations"] = stage_activations(m, g, tr, batch, stage)
    out["total"] = sum(out.values())
    return out


# -----------------------------------------------------------------------------
# FLOPs, and time per step: compute, and the communication not hidden
# -----------------------------------------------------------------------------
def matrix_parameters(m):
    """Weights of a block's matrix products per token, a mixture's k chosen MLPs: the FLOPs are twice."""
    h = m.hidden
    mlp = 3 * h * m.ffn_hidden if m.ffn_hidden else 8 * h * h
    if m.experts > 1:
        return 2 * h * h + 2 * h * m.kv_width + mlp * m.top_k + h * m.experts
    return 2 * h * h + 2 * h * m.kv_width + mlp


def block_flops(m, tokens):
    """Forward FLOPs of one block for `tokens` tokens of whole sequences (Narayanan et al. 2021:
    24 t h^2 + 4 t s h; grouped-query attention and SwiGLU change the matrices; a mixture runs k MLPs
    and a router of 2 t h E)."""
    return 2 * tokens * matrix_parameters(m) + 4 * tokens * m.seq_len * m.hidden


def model_flops(m, batch, recompute="none"):
    """FLOPs of one optimizer step, all GPUs: 3 passes (forward, two for backward), 4 with full
    recomputation of the blocks, attention's core once more with selective; the head 3 passes of 2thV."""
    tokens = batch * m.seq_len
    passes = 4 if recompute == "full" else 3
    extra = 4 * tokens * m.seq_len * m.hidden * m.layers if recompute == "selective" else 0
    return passes * m.layers * block_flops(m, tokens) + extra + 3 * 2 * tokens * m.hidden * m.vocab


@dataclasses.dataclass(frozen=True)
class Skill:
    """The GPU step-time model's two constants, fitted to published runs (fit(), published_runs())."""
    gemm: float          # the share of peak the matrix products reach
    elementwise: float   # passes, per pass of the block, over the bytes a block keeps, by the other kernels


# The kernels besides matrix products, eager (PyTorch without torch.compile: each of RMSNorm's float32
# steps, rotary's complex product, SwiGLU's silu and product, repeat_kv a kernel of its own) against fused
# (Megatron's, Transformer Engine's, torch.compile's): counted in bytes read and written per token of a
# Llama block, forward and backward, 415h against about 100h (docs/plan.md): 4 times the traffic.
EAGER = {"fused": 1.0, "eager": 4.0}


def compute_terms(m, g, tr, batch, stage, hw):
    """One GPU of `stage`, per step, in seconds: (the matrix products' FLOPs at peak, the bytes the
    blocks keep at the memory's bandwidth, FlashAttention's FLOPs at its share of peak). The skill model's
    compute is the first / gemm + the second x elementwise + the third. Eager attention's per-head
    products (q k^T, the scores times v) count as matrix products; their scores are in the kept bytes."""
    lo, hi = layer_split(m.layers, g.pp)[stage]
    blocks, t, h = hi - lo, g.tp, m.hidden
    b, s = batch // g.dp // g.micro, m.seq_len
    rows, peak = b * m.seq_len // g.cp, hw.peak[tr.precision]
    passes = 4 if tr.recompute == "full" else 3
    again = tr.recompute != "none"            # attention's core runs forward again with either recomputation
    core = 4 * rows * s * h / t                # its counted FLOPs, one forward
    if tr.attention == "flash" or g.cp > 1:   # causal: half of them computed; backward recomputes the scores,
        flash = (1 + again + 2.5) * core / 2 / (hw.flash * peak)   # 5 products to the forward's 2 (Dao 2023)
        core = 0.0
    else:
        flash, core = 0.0, (3 + again) * core
    matrices = passes * 2 * rows * matrix_parameters(m) / t
    at_peak = blocks * (matrices + core) / peak
    kept = blocks * passes * block_activations(m, g, tr, b, "none")
    if stage == g.pp - 1:                      # the head, and the loss's float32 logits
        vocab = padded_vocab(m.vocab, t) / t
        at_peak += 3 * 2 * rows * h * vocab / peak
        kept += 3 * 4 * rows * vocab
    return g.micro * at_peak, g.micro * kept * EAGER[tr.kernels] / hw.hbm_bandwidth, g.micro * blocks * flash


def stage_flops(m, g, tr, batch, stage):
    """FLOPs one GPU of `stage` computes per step (recomputation included)."""
    lo, hi = layer_split(m.layers, g.pp)[stage]
    tokens = batch // g.dp * m.seq_len // g.cp           # this GPU's, all micro-batches
    passes = 4 if tr.recompute == "full" else 3
    flops = passes * (hi - lo) * block_flops(m, tokens) / g.tp
    if tr.recompute == "selective":
        flops += 4 * tokens * m.seq_len * m.hidden * (hi - lo) / g.tp
    if stage == g.pp - 1:
        flops += 3 * 2 * tokens * m.hidden * m.vocab / g.tp
    return flops


def link(g, hw, axis):
    """(alpha, beta) of an axis: inside a node when its group's span fits one (Megatron's order: tensor
    fastest, then context, data, pipeline), else InfiniBand."""
    stride = {"tensor": 1, "context": g.tp, "data": g.tp * g.cp, "expert": g.tp * g.cp, "pipeline": g.tp * g.cp * g.dp}
    size = {"tensor": g.tp, "context": g.cp, "data": g.dp, "expert": g.ep, "pipeline": g.pp}   # data: with cp's
    return hw.intra if stride[axis] * size[axis] <= hw.gpus_per_node else hw.inter


def collective_time(n, moved, calls, alpha, beta, kind):
    """Ring algorithms: an allreduce moves 2(n-1)/n of its vector in and out of each rank in 2(n-1)
    steps; a reduce-scatter, an all-gather and an all-to-all (n-1)/n in n-1 (data_parallel.py,
    sharded_data_parallel.py, context_parallel.py's docstrings). As (latency, seconds at beta)."""
    if n <= 1 or not moved:
        return 0.0, 0.0
    factor = 2 if kind == "allreduce" else 1
    return calls * factor * (n - 1) * alpha, factor * (n - 1) / n * moved / beta


@functools.lru_cache(maxsize=4096)
def stage_terms(m, g, tr, batch, hw, stage):
    """What one GPU of `stage` spends per step, before any constant of the skill model: the compute's
    terms (compute_terms, and the FLOPs at the rate), each axis's (latency, seconds at the link's beta)."""
    lo, hi = layer_split(m.layers, g.pp)[stage]
    blocks, nccl = hi - lo, not hw.cores
    b = axis_bytes(m, g, tr, batch, stage)
    plain = axis_bytes(m, dataclasses.replace(g, sp=False), tr, batch, stage)
    # the tensor axis's sums: float32 through MPI (the files), in the activations' dtype through NCCL
    wire = plain["tensor"] * (tr.element / 4 if nccl else 1)
    comm = {"tensor": collective_time(g.tp, wire, g.micro * (4 * blocks + 2), *link(g, hw, "tensor"), "allreduce")}
    alpha, beta = link(g, hw, "context")
    comm["context"] = (0.0, 0.0)
    if g.cp > 1 and g.cp_comm == "ring":                 # (N-1) hops a pass, each alpha + block
        comm["context"] = (3 * g.micro * blocks * (g.cp - 1) * alpha, b["context"] / beta)
    elif g.cp > 1:
        comm["context"] = collective_time(g.cp, b["context"], g.micro * blocks * 4, alpha, beta, "allgather")
    calls = g.micro * blocks * (6 if tr.recompute == "full" else 4)   # dispatch and combine, each way
    comm["expert"] = collective_time(g.ep, b["expert"], calls, *link(g, hw, "expert"), "alltoall")
    alpha, beta = link(g, hw, "pipeline")
    messages = 2 * g.micro * (g.virtual if g.schedule == "interleaved" else 1)
    comm["pipeline"] = (messages * alpha, b["pipeline"] / beta) if g.pp > 1 else (0.0, 0.0)
    if g.pp > 1 and tr.scatter_gather and g.tp > 1:      # and the all-gather of the pieces in the node
        gather = collective_time(g.tp, b["pipeline"] * g.tp, messages, *link(g, hw, "tensor"), "allgather")
        comm["pipeline"] = tuple(x + y for x, y in zip(comm["pipeline"], gather))
    if g.zero and tr.weights == "autocast":             # reduce-scatter and all-gather of the padded buckets
        data = 8 * hybrid_zero_padded(sum(d + x for d, x in stage_layers(m, g, stage)), g.dp * g.cp)
    else:
        data = b["data"]
    comm["data"] = collective_time(g.dp * g.cp, data, 1, *link(g, hw, "data"), "allreduce" if not g.zero else "rs_ag")
    params = sum(d + x for d, x in stage_layers(m, g, stage))
    state = params / (g.dp * g.cp if g.zero else 1)
    update = state * (28 if tr.optimizer == "adam" else 20) / hw.hbm_bandwidth  # read and write the state
    return {"compute": compute_terms(m, g, tr, batch, stage, hw) if nccl else None,
            "flops": stage_flops(m, g, tr, batch, stage), "comm": comm, "update": update}


def step_time(m, g, tr, batch, hw, skill):
    """Seconds per step on the slowest stage, by term. skill: a Skill (the fitted GPU model), or a float:
    every FLOP at that share of the rate (--efficiency; the CPU's calibration, at 1)."""
    worst = None
    for stage in representative_stages(g.pp):
        terms = stage_terms(m, g, tr, batch, hw, stage)
        if isinstance(skill, Skill):
            at_peak, kept, flash = terms["compute"]
            compute = at_peak / skill.gemm + kept * skill.elementwise + flash
        else:
            compute = terms["flops"] / (hw.rate(tr.precision, g.gpus) * skill)
        spent = {axis: latency + seconds for axis, (latency, seconds) in terms["comm"].items()}
        tensor = max(0.0, spent["tensor"] - compute) if tr.overlap == "full" else spent["tensor"]
        pipeline = max(0.0, spent["pipeline"] - compute) if tr.overlap == "full" else spent["pipeline"]
        per_step = compute + tensor + spent["context"] + spent["expert"] + pipeline
        stretched = per_step / (1 - bubble(g))               # the bubble stretches the whole pipeline
        # What hides the data axis, as the files overlap it: plain data parallelism's buckets and stage 2's
        # reduce-scatters behind the last micro-batch's backward (stage 2's all-gather after the step is
        # exposed); stage 1 nothing (after backward; hybrid_parallel.py's ZeRO-1 posts its reduce-scatters
        # in backward); stage 3's prefetched gathers behind all the compute. "full": every reduce-scatter
        # behind the last backward, every all-gather behind the first forward (Megatron-Core's overlaps).
        data, backward = spent["data"], (compute / g.micro) * 2 / 3
        scatter = data / 2 if g.zero else data
        if tr.overlap == "full":
            hidden = compute if g.zero == 3 else min(scatter, backward) + min(data - scatter, backward / 2)
        elif tr.overlap == "files":
            zero1 = min(backward, scatter) if tr.weights == "autocast" else 0.0
            hidden = {0: backward, 1: zero1, 2: min(backward, scatter), 3: compute}[g.zero]
        else:
            hidden = 0.0
        exposed = max(0.0, data - hidden)
        total = stretched + exposed + terms["update"]
        out = {"compute": compute, "tensor": tensor, "context": spent["context"], "expert": spent["expert"],
               "pipeline": pipeline, "bubble": stretched - per_step, "data_exposed": exposed,
               "optimizer": terms["update"], "total": total}
        if worst is None or total > worst["total"]:
            worst = out
    return worst


# -----------------------------------------------------------------------------
# One grid, every term; the search over grids
# -----------------------------------------------------------------------------
class PlanError(Exception):
    """An impossible grid or input: one line, exit status 2."""


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
CP_COMMS = ("ring", "allgather", "alltoall")


def check_grid(m, g, tr, batch, gpus=None, hybrid=False):
    """The first thing wrong with grid g for this model and batch, as a PlanError."""
    kv = m.kv_heads or m.heads
    checks = [
        (g.schedule not in SCHEDULES, f"schedule={g.schedule} is not one of {', '.join(SCHEDULES)}"),
        (g.cp_comm not in CP_COMMS, f"cp_comm={g.cp_comm} is not one of {', '.join(CP_COMMS)}"),
        (g.zero not in (0, 1, 2, 3), f"zero={g.zero} must be 0, 1, 2 or 3"),
        (g.virtual > 1 and g.schedule != "interleaved",
         f"virtual={g.virtual} chunks a rank need schedule=interleaved, not {g.schedule}"),
        (g.pp == 1 and g.schedule not in ("1f1b", "gpipe"), f"schedule={g.schedule} needs pp=2 or more"),
        (g.sp and g.tp == 1, "sp=1 (sequence parallelism) needs tp=2 or more"),
        (m.heads % g.tp, f"tp={g.tp} does not divide --heads {m.heads}"),
        (kv % g.tp, f"tp={g.tp} does not divide --kv-heads {kv}"),
        (m.ffn_hidden % g.tp, f"tp={g.tp} does not divide --ffn-hidden {m.ffn_hidden}"),
        (gpus and g.gpus != gpus, f"dp x tp x pp x cp = {g.gpus} GPUs, not the {gpus} given"),
        (g.pp * g.virtual > m.layers,
         f"pp={g.pp} x virtual={g.virtual} chunks need at least {g.pp * g.virtual} --layers, got {m.layers}"),
        (batch % (g.dp * g.micro),
         f"--batch-size {batch} does not split into dp={g.dp} replicas x micro={g.micro} micro-batches"),
        (g.cp > 1 and m.seq_len % (2 * g.cp),
         f"cp={g.cp} does not divide --seq-len {m.seq_len} into 2 x {g.cp} chunks"),
        (g.sp and (m.seq_len // g.cp) % g.tp,
         f"sp=1 needs --seq-len {m.seq_len} to split into the {g.tp} tensor-parallel ranks' pieces"),
        (g.cp > 1 and g.cp_comm == "alltoall" and (m.heads // g.tp) % g.cp,
         f"cp_comm=alltoall needs cp={g.cp} to divide --heads {m.heads} / tp {g.tp}"),
        (g.ep > 1 and m.experts == 1, f"ep={g.ep} needs --experts 2 or more"),
        (m.experts % g.ep or (g.dp * g.cp) % g.ep,
         f"ep={g.ep} must divide --experts {m.experts} and dp x cp = {g.dp * g.cp}"),
        (g.zero and m.experts > 1, "ZeRO with a mixture of experts is not modelled; use zero=0"),
        (g.schedule == "interleaved" and g.micro % g.pp, f"interleaved needs micro={g.micro} a multiple of pp={g.pp}"),
    ]
    why = next((words for wrong, words in checks if wrong), None)
    if why is None and hybrid:
        why = hybrid_refusal(m, g, tr)
    if why:
        raise PlanError(why)


def hybrid_refusal(m, g, tr):
    """What hybrid_parallel.py does not run: its grid is dp x cp x tp x pp, 1F1B, ZeRO-1 at most, the
    context axis a ring, experts top-1 or top-2, its own GPT."""
    checks = [
        (g.pp > 1 and g.schedule != "1f1b", f"hybrid_parallel.py runs 1F1B, not schedule={g.schedule}"),
        (g.zero > 1, f"hybrid_parallel.py runs ZeRO-1 at most, not zero={g.zero}"),
        (g.cp > 1 and g.cp_comm != "ring", f"hybrid_parallel.py's context axis is a ring, not cp_comm={g.cp_comm}"),
        (m.experts > 1 and m.top_k > 2,
         f"hybrid_parallel.py routes each token to 1 or 2 experts, not --top-k {m.top_k}"),
        (m.kv_heads or m.ffn_hidden,
         "hybrid_parallel.py has no --kv-heads or --ffn-hidden (its GPT: every head its own k and v, a GELU MLP)"),
    ]
    return next((words for wrong, words in checks if wrong), None)


def evaluate(m, g, tr, batch, hw, skill, usable):
    busiest, total = grid_bytes(m, g, tr, batch)
    mem = max((memory(m, g, tr, batch, s) for s in representative_stages(g.pp)), key=lambda d: d["total"])
    time = step_time(m, g, tr, batch, hw, skill)
    flops = model_flops(m, batch, "none")
    hardware_flops = model_flops(m, batch, tr.recompute)
    return {"grid": dataclasses.asdict(g), "fits": mem["total"] <= usable * hw.hbm,
            "memory_bytes_per_gpu": {k: round(v) for k, v in mem.items()},
            "bytes_per_step": busiest, "bytes_per_step_all_gpus": total,
            "bubble": bubble(g), "step_seconds": time["total"], "step_seconds_by_term": time,
            "tokens_per_second_per_gpu": batch * m.seq_len / time["total"] / g.gpus,
            "tflops_per_gpu": hardware_flops / time["total"] / g.gpus / 1e12,
            "mfu": flops / time["total"] / g.gpus / hw.rate(tr.precision, g.gpus)}


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(m, gpus, batch, hw, hybrid=False):
    """Every grid worth trying: tp within a node dividing the heads (and kv heads, the MLP), pp dividing
    the GPUs left, cp a power of two (hybrid_parallel.py: any that cuts the sequence in 2 cp chunks), ep
    dividing the experts and dp x cp, ZeRO 0-3 (hybrid_parallel.py: 0 and 1), sequence parallelism with
    tp > 1, micro-batches of 1, 2, 4 or 8 sequences, 1F1B."""
    kv = m.kv_heads or m.heads
    for tp in (t for t in divisors(gpus) if m.heads % t == 0 == kv % t == m.ffn_hidden % t and t <= hw.gpus_per_node):
        cps = (c for c in divisors(gpus // tp) if c == 1 or (hybrid or c & (c - 1) == 0) and m.seq_len % (2 * c) == 0)
        for cp in cps:
            for pp in (p for p in divisors(gpus // (tp * cp)) if p <= m.layers):
                dp = gpus // (tp * cp * pp)
                if batch % dp:
                    continue
                share = batch // dp
                for ep in (e for e in divisors(dp * cp) if m.experts % e == 0) if m.experts > 1 else (1,):
                    zeros = (0,) if dp * cp == 1 or m.experts > 1 else (0, 1) if hybrid else (0, 1, 2, 3)
                    for zero in zeros:
                        for sp in ((False, True) if hybrid else (True,)) if tp > 1 else (False,):
                            if sp and (m.seq_len // cp) % tp:
                                continue
                            for size in (z for z in (1, 2, 4, 8) if share % z == 0):
                                yield Grid(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro=share // size, sp=sp)


def peak_memory(m, g, tr, batch):
    return max(memory(m, g, tr, batch, s)["total"] for s in representative_stages(g.pp))


def search(m, tr, gpus, batch, hw, skill, usable, top, hybrid=False):
    """The grids that fit, fastest first: memory and time on every candidate, every term on the best."""
    tried = list(candidates(m, gpus, batch, hw, hybrid))
    fits = [g for g in tried if peak_memory(m, g, tr, batch) <= usable * hw.hbm]
    timed = sorted(fits, key=lambda g: step_time(m, g, tr, batch, hw, skill)["total"])
    return [evaluate(m, g, tr, batch, hw, skill, usable) for g in timed[:top]], tried


def gpus_needed(m, tr, batch, hw, usable, hybrid=False):
    """The fewest GPUs (whole nodes, batch permitting) on which some grid fits memory."""
    n = hw.gpus_per_node if hw.gpus_per_node < 1 << 20 else 1
    while n <= 1 << 16:
        for g in candidates(m, n, batch, hw, hybrid):
            if peak_memory(m, g, tr, batch) <= usable * hw.hbm:
                return n
        n *= 2
    return None


# -----------------------------------------------------------------------------
# The step-time model against published runs: its constants fitted, each run predicted held out
# -----------------------------------------------------------------------------
# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (SC21, arXiv:2104.04473), Table 1: achieved TFLOP/s per GPU, counted with their eq. 3 (recomputation
# included), on DGX A100s (80 GB), fp16, sequences of 2,048, vocabulary 51,200. The table's figures were
# written down without the PDF at hand (the aggregates, percentages of 312 TFLOP/s and the abstract's 502
# petaFLOP/s at 3,072 GPUs agree with them). How each ran: Megatron-LM's own scripts for the paper,
# examples/academic_paper_scripts/sc21/run_table_1.sh (micro-batch size, layers per virtual stage,
# DDP implementation, --activations-checkpoint-method uniform: full recomputation; CONFIG.sh: --fp16).
# Their attention is eager (2021: no FlashAttention), their pipeline sends scattered over the tensor-
# parallel ranks and gathered in the node, their "local" DDP reduces after backward, torch's during it.
NARAYANAN = "Narayanan et al. 2021, Table 1"
#           (label, heads, hidden, layers, tp, pp, GPUs, batch, micro-batch size, virtual stages, DDP, TFLOP/s)
NARAYANAN_TABLE_1 = [("1.7 B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, "torch", 137),
                     ("3.6 B", 32, 3072, 30, 2, 1, 64, 512, 16, 1, "torch", 138),
                     ("7.5 B", 32, 4096, 36, 4, 1, 128, 512, 16, 1, "torch", 142),
                     ("18.4 B", 48, 6144, 40, 8, 1, 256, 1024, 8, 1, "torch", 135),
                     ("39.1 B", 64, 8192, 48, 8, 2, 512, 1536, 4, 1, "local", 138),
                     ("76.1 B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, "local", 140),
                     ("145.6 B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, "local", 148),
                     ("310.1 B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, "local", 155),
                     ("529.6 B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, "local", 163),
                     ("1008 B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, "local", 163)]
# torchtitan, docs/performance.md (torchtitan 9dec370 with torch 1963fc8, December 2024): Llama 3.1 8B
# with FSDP on 8 H100s (Table 1, local batch 2, global 16) and on 128 (Table 3, local batch 2, global
# 256), bf16, selective activation checkpointing (train_configs/llama3_8b.toml: the 'op' policy, seq_len
# 8192), the rows "FSDP" (no torch.compile, no Float8): 5,762 and 5,605 tokens per second per GPU. Its
# H100s: 96 GB HBM2e at 2.4 TB/s, NVLink in a host, 400 Gb/s RDMA per GPU, a 500 W limit (their peak
# "between SXM and NVL": the SXM's 989 TFLOP/s here, as their MFU counts it; the power limit not modelled).
TORCHTITAN = "torchtitan docs/performance.md"
TORCHTITAN_H100 = Hardware("H100 96GB HBM2e, 8 a host (Grand Teton, 500 W)", {"bf16": 989e12, "fp32": 67e12}, 96e9,
                           2.4e12, 8, (5e-6, 450e9), (10e-6, 50e9), flash=0.34)
LLAMA3_8B = Model(32, 4096, 32, 8192, 128256, kv_heads=8, ffn_hidden=14336)
LLAMA3_70B = Model(80, 8192, 64, 8192, 128256, kv_heads=8, ffn_hidden=28672)
# Megatron-LM's README, "Performance Benchmarking" (images/model_table.png: Megatron-Core r0.8.0 on H100s,
# vocabulary 131,072, sequences of 4,096, overlapped data-, tensor- and pipeline-parallel communication):
# the 1.7 B row, 24 blocks x 2048 hidden, 16 heads, tp 1, pp 1, dp 48, batch 192: 408.8 TFLOP/s per GPU
# (41% MFU: model FLOPs, no recomputation counted). Not stated, assumed: bf16, FlashAttention, no
# recomputation, micro-batches of one sequence.
MEGATRON_CORE = "Megatron-LM README, H100 table"


@dataclasses.dataclass(frozen=True)
class Published:
    source: str
    label: str
    model: Model
    grid: Grid
    training: Training
    hardware: Hardware
    batch: int
    value: float
    unit: str            # "TFLOP/s eq. 3" (recomputation counted), "TFLOP/s" (the model's), "tokens/s"

    def step_from(self, value):
        """The step in seconds that `value` (in the row's unit, per GPU) stands for."""
        if self.unit == "tokens/s":
            return self.batch * self.model.seq_len / (value * self.grid.gpus)
        recompute = self.training.recompute if self.unit == "TFLOP/s eq. 3" else "none"
        return model_flops(self.model, self.batch, recompute) / (value * 1e12 * self.grid.gpus)

    def predicted(self, skill):
        """The row's figure as plan.py predicts it with `skill`."""
        step = step_time(self.model, self.grid, self.training, self.batch, self.hardware, skill)["total"]
        return self.value * self.step_from(self.value) / step


def published_runs():
    rows = []
    for label, heads, hidden, layers, tp, pp, gpus, batch, size, virtual, ddp, tflops in NARAYANAN_TABLE_1:
        dp = gpus // (tp * pp)
        grid = Grid(dp=dp, tp=tp, pp=pp, micro=batch // dp // size, virtual=virtual,
                    schedule="interleaved" if virtual > 1 else "1f1b")
        training = Training("bf16", "full", "eager", overlap="files" if ddp == "torch" else "none", scatter_gather=True)
        rows.append(Published(NARAYANAN, label, Model(layers, hidden, heads, 2048, 51200), grid, training,
                              PRESETS["a100"], batch, tflops, "TFLOP/s eq. 3"))
    titan = Training("bf16", "selective", "flash", kernels="eager")
    rows += [Published(TORCHTITAN, "Llama 3.1 8B, 8 H100s", LLAMA3_8B, Grid(dp=8, zero=3), titan, TORCHTITAN_H100,
                       16, 5762, "tokens/s"),
             Published(TORCHTITAN, "Llama 3.1 8B, 128 H100s", LLAMA3_8B, Grid(dp=128, zero=3), titan, TORCHTITAN_H100,
                       256, 5605, "tokens/s"),
             Published(MEGATRON_CORE, "70 B, 768 H100s", Model(84, 8192, 64, 4096, 131072),
                       Grid(dp=48, tp=8, pp=2, zero=1, micro=8, sp=True),
                       Training("bf16", "none", "flash", overlap="full"), PRESETS["h100"], 384, 419.7, "TFLOP/s")]
    return rows


# The constants fitted to every row of published_runs() (fit(); tests/test_plan.py fits them again).
SKILL = Skill(gemm=0.691, elementwise=2.40)


def log_error(rows, skill):
    return sum(math.log(row.predicted(skill) / row.value) ** 2 for row in rows)


def to_skill(x):
    """Unbounded coordinates to constants: the share of peak in (0, 1), the passes > 0."""
    return Skill(gemm=1 / (1 + math.exp(-x[0])), elementwise=math.exp(x[1]))


def from_skill(skill):
    return [math.log(skill.gemm / (1 - skill.gemm)), math.log(skill.elementwise)]


def nelder_mead(f, x0, step=0.5, iterations=400, tolerance=1e-10):
    """Minimise f from x0 (the standard library's way: plan.py needs nothing installed)."""
    points = [list(x0)] + [[v + (step if i == j else 0) for j, v in enumerate(x0)] for i in range(len(x0))]
    values = [f(p) for p in points]
    for _ in range(iterations):
        order = sorted(range(len(points)), key=values.__getitem__)
        points, values = [points[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centre = [sum(p[i] for p in points[:-1]) / (len(points) - 1) for i in range(len(x0))]
        move = lambda k: [c + k * (c - w) for c, w in zip(centre, points[-1])]  # noqa: E731
        reflected = move(1)
        fr = f(reflected)
        if fr < values[0]:
            expanded = move(2)
            fe = f(expanded)
            points[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            points[-1], values[-1] = reflected, fr
        else:
            contracted = move(-0.5)
            fc = f(contracted)
            if fc < values[-1]:
                points[-1], values[-1] = contracted, fc
            else:   # shrink towards the best
                points = [points[0]] + [[b + 0.5 * (v - b) for b, v in zip(points[0], p)] for p in points[1:]]
                values = [values[0]] + [f(p) for p in points[1:]]
    best = min(range(len(points)), key=values.__getitem__)
    return points[best]


def fit(rows, start=SKILL):
    """The Skill that minimises the squared log-errors over `rows`."""
    return to_skill(nelder_mead(lambda x: log_error(rows, to_skill(x)), from_skill(start)))


def fit_constant(rows):
    """The one share of peak for every FLOP (--efficiency) that minimises the same errors."""
    def error(x):
        return sum(math.log(row.predicted(1 / (1 + math.exp(-x[0]))) / row.value) ** 2 for row in rows)
    return 1 / (1 + math.exp(-nelder_mead(error, [0.0])[0]))


def spearman(xs, ys):
    """Rank correlation (ties share their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def held_out(rows=None):
    """Leave-one-out: each row predicted by the skill model and by a constant share of peak, both
    fitted to every other row. Returns [(row, skill's prediction, constant's prediction)]."""
    rows = rows or published_runs()
    out = []
    for i, row in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        out.append((row, row.predicted(fit(others)), row.predicted(fit_constant(others))))
    return out


# -----------------------------------------------------------------------------
# The command line
# -----------------------------------------------------------------------------
NCCL_NOTE = ("GPU times assume NCCL-class collectives; the strategy files exchange through MPI (host-staged unless "
             "CUDA-aware), slower")


def parse_grid(text):
    """--grid dp=..,tp=..: each key once, each value checked, or a PlanError naming what is wrong."""
    keys = [f.name for f in dataclasses.fields(Grid)]
    given, values = {}, {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in keys or not value:
            raise PlanError(f"--grid takes key=value pairs of {', '.join(keys)}; got {item.strip()!r}")
        if key in given:
            raise PlanError(f"--grid gives {key} twice ({key}={given[key]} and {key}={value}); give it once")
        given[key] = value
        if key in ("schedule", "cp_comm"):
            choices = SCHEDULES if key == "schedule" else CP_COMMS
            if value not in choices:
                raise PlanError(f"--grid {key}={value}: use one of {', '.join(choices)}")
            values[key] = value
        elif key == "sp":
            if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise PlanError(f"--grid sp={value}: use sp=1 (sequence parallelism) or sp=0")
            values[key] = value.lower() in ("1", "true", "yes")
        else:
            try:
                values[key] = int(value)
            except ValueError:
                raise PlanError(f"--grid {key}={value}: not a whole number") from None
            if values[key] < (0 if key == "zero" else 1):
                raise PlanError(f"--grid {key}={value} must be {'0 or more' if key == 'zero' else '1 or more'}")
    return Grid(**values)


def grid_of_run(result):
    """The grid a strategy file ran on, from its --json."""
    n, name = result["world_size"], result["strategy"]
    if name == "hybrid_parallel":
        grid = result["grid"]
        return Grid(dp=grid["dp"], tp=grid["tp"], pp=grid["pp"], cp=grid.get("cp", 1), ep=grid.get("ep", 1),
                    zero=result.get("zero_stage", 0), micro=result["micro_batches"],
                    sp=bool(result.get("sequence_parallel")))
    return {"tensor_parallel": Grid(tp=n, sp=bool(result.get("sequence_parallel"))),
            "pipeline_parallel": Grid(pp=n, micro=result.get("micro_batches", 1),
                                      schedule=result.get("schedule", "1f1b"), virtual=result.get("virtual_stages", 1)),
            "sharded_data_parallel": Grid(dp=n, zero=result.get("zero_stage", 0)),
            "context_parallel": Grid(cp=n, cp_comm=result.get("cp_comm", "ring")),
            "expert_parallel": Grid(dp=n, ep=result.get("ep", 1))}.get(name, Grid(dp=n))


def training_of_run(result, optimizer):
    """How a strategy file's run trained, from its --json: sharded_data_parallel.py keeps bf16 weights with
    float32 masters apart, the others float32 weights under autocast; all of them eager attention."""
    return Training(result.get("precision", "fp32"), result.get("recompute", "none"), "eager", optimizer,
                    "master" if result["strategy"] == "sharded_data_parallel" else "autocast")


def calibrate(m, g, tr, batch, result, cores=None):
    """FLOP/s per core at which plan.py's step on the run's grid takes the run's measured step_time_s
    (a strategy file's --json, launched with this model and batch): the communication terms stay as
    modelled, the compute takes the rest. Its ranks share the cores (cpu_hardware)."""
    rate = model_flops(m, batch, tr.recompute) / result["step_time_s"] / min(cores or machine_cores(), g.gpus)
    for _ in range(30):   # the compute is work / rate, the rest hardly moves with the rate: a fixed point
        t = step_time(m, g, tr, batch, cpu_hardware(rate, cores), 1.0)
        rate *= t["total"] / result["step_time_s"]
    return rate


def read_run(path):
    """A strategy file's --json output (its last line), or a PlanError that says what is wrong with it."""
    try:
        with open(path) as f:
            lines = f.read().strip().splitlines()
    except OSError as e:
        raise PlanError(f"--calibrate {path}: {e.strerror.lower()}") from None
    if not lines:
        raise PlanError(f"--calibrate {path} is empty: give a strategy file's --json output")
    try:
        result = json.loads(lines[-1])
    except ValueError:
        raise PlanError(f"--calibrate {path}: its last line is not JSON; give a strategy file's --json "
                        f"output") from None
    missing = [k for k in ("strategy", "world_size", "step_time_s") if not isinstance(result, dict) or k not in result]
    if missing:
        raise PlanError(f"--calibrate {path}: no {', '.join(missing)} in its last line; give a strategy file's "
                        f"--json output")
    if not result["step_time_s"] or result["step_time_s"] <= 0:
        raise PlanError(f"--calibrate {path}: step_time_s {result['step_time_s']} is not a measured step")
    return result


class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not argparse's usage and message
        raise PlanError(message.replace("argument ", "", 1))


def checked(kind, test, words):
    """An argparse type: `kind`, and `test` true of it, else a one-line message of what the flag takes."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{words}, got {text}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{words}, got {text}")
        return value
    return parse


COUNT = checked(int, lambda v: v >= 1, "a whole number, 1 or more")
SHARE = checked(float, lambda v: 0 < v <= 1, "a share in (0, 1]")
POSITIVE = checked(float, lambda v: v > 0 and math.isfinite(v), "a positive number")


def parse_args(argv):
    p = Parser(description="Which grid? Memory and step time per GPU for a GPT on a cluster. " + NCCL_NOTE + ".",
               epilog="python plan.py --published: the step-time model against the published runs it is fitted to, "
                      "each held out of the fit in turn.")
    p.add_argument("--layers", type=COUNT, help="transformer blocks")
    p.add_argument("--hidden", type=COUNT, help="hidden size")
    p.add_argument("--heads", type=COUNT, help="attention heads")
    p.add_argument("--kv-heads", type=COUNT,
                   help="heads of keys and values (grouped-query attention; default: --heads)")
    p.add_argument("--ffn-hidden", type=COUNT, help="a SwiGLU MLP this wide, three matrices without biases "
                   "(Llama's; default: the files' GELU MLP of 4 x hidden)")
    p.add_argument("--seq-len", type=COUNT, help="tokens per sequence")
    p.add_argument("--vocab", type=COUNT, default=128, help="vocabulary (the files: 128 ASCII codes)")
    p.add_argument("--experts", type=COUNT, default=1, help="experts per block (1: a dense MLP)")
    p.add_argument("--top-k", type=COUNT, default=1, help="experts per token")
    p.add_argument("--batch-size", type=COUNT, help="global batch, in sequences")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--attention", choices=("flash", "eager"), default="flash",
                   help="flash (default, what a GPU framework runs): FlashAttention keeps no s x s scores, its "
                        "log-sum-exp instead; eager: the files' softmax, kept whole for backward")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                   help="adam: 8 bytes of state a parameter; sgd: momentum, 4 (hybrid_parallel.py's SGD)")
    p.add_argument("--overlap", choices=("files", "none", "full"), default="files",
                   help="what hides behind compute: files (as the strategy files overlap), none, or full "
                        "(Megatron-Core's gradient, parameter and tensor-parallel overlaps)")
    p.add_argument("--kernels", choices=("fused", "eager"), default="fused",
                   help="the kernels besides matrix products: fused (Megatron, torch.compile) or eager PyTorch")
    p.add_argument("--gpus", type=COUNT, help="GPUs in all (default: the grid's, with --grid)")
    p.add_argument("--gpu", default="h100", help="a100, h100, h200, or cpu (with --flops or --calibrate)")
    p.add_argument("--gpus-per-node", type=COUNT, help="override the preset's 8")
    p.add_argument("--efficiency", type=SHARE, help="instead of the fitted model: every FLOP at this share of peak")
    p.add_argument("--usable", type=SHARE, default=0.9, help="share of HBM a plan may fill")
    p.add_argument("--flops", type=POSITIVE, help="--gpu cpu: FLOP/s of one core (what --calibrate finds)")
    p.add_argument("--calibrate", metavar="JSON", help="--gpu cpu: a strategy file's --json output, run with this "
                   "model and --batch-size (its FLOP/s per core are solved for)")
    p.add_argument("--grid", help="one grid: dp=..,tp=..,pp=..,cp=..,ep=..,zero=..,micro=..,schedule=..,virtual=..,"
                   "sp=0|1,cp_comm=..")
    p.add_argument("--top", type=COUNT, default=10, help="grids to print")
    p.add_argument("--hybrid", action="store_true", help="only grids hybrid_parallel.py runs: dp x cp x tp x pp, "
                   "1F1B, ZeRO-1 at most, the context ring, experts, sequence parallelism; its memory (float32 "
                   "weights under autocast, SGD's momentum with --optimizer sgd)")
    p.add_argument("--published", action="store_true", help="the step-time model against published runs, held out")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line: inputs, assumptions, plans")
    return p.parse_args(argv)


def check_args(args):
    """The inputs' own consistency, in the order a reader would fix them."""
    for name in ("layers", "hidden", "heads", "seq_len", "batch_size"):
        if getattr(args, name) is None:
            raise PlanError(f"--{name.replace('_', '-')} is required (or --published alone)")
    if args.hidden % args.heads:
        raise PlanError(f"--hidden {args.hidden} does not split into {args.heads} heads")
    if args.kv_heads and args.heads % args.kv_heads:
        raise PlanError(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} (each group of query heads "
                        f"shares one)")
    if args.top_k > 1 and args.experts == 1:
        raise PlanError(f"--top-k {args.top_k} routes to experts, but --experts is 1 (a dense MLP)")
    if args.experts > 1 and args.top_k > args.experts:
        raise PlanError(f"--top-k {args.top_k} is more experts than the {args.experts} there are")
    if args.gpu != "cpu" and (args.flops or args.calibrate):
        raise PlanError(f"--{'flops' if args.flops else 'calibrate'} is for --gpu cpu, not --gpu {args.gpu}")
    if args.gpu == "cpu" and args.gpus_per_node:
        raise PlanError("--gpus-per-node is for GPUs: --gpu cpu runs every rank on this machine")
    if args.gpu == "cpu" and args.efficiency:
        raise PlanError("--efficiency is for GPUs: --gpu cpu's FLOP/s come from --flops or --calibrate")


def hardware(args, m, tr):
    if args.gpu == "cpu":
        flops = args.flops
        if args.calibrate:
            result = read_run(args.calibrate)
            files = dataclasses.replace(tr, attention="eager")     # the files' attention
            flops = calibrate(m, grid_of_run(result), files, args.batch_size, result)
        if not flops:
            raise PlanError("--gpu cpu needs --flops X or --calibrate RUN.json (a strategy file's --json output)")
        return cpu_hardware(flops), 1.0
    if args.gpu not in PRESETS:
        raise PlanError(f"--gpu {args.gpu}: use one of {', '.join(PRESETS)} or cpu")
    hw = PRESETS[args.gpu]
    if args.gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    return hw, args.efficiency or SKILL


def describe(p):
    """A grid in --grid's words."""
    g = p["grid"]
    parts = [f"dp={g['dp']}", f"tp={g['tp']}", f"pp={g['pp']}", f"cp={g['cp']}"]
    parts += [f"ep={g['ep']}"] if g["ep"] > 1 else []
    parts += [f"zero={g['zero']}", f"micro={g['micro']}"]
    parts += [f"schedule={g['schedule']}"] if g["pp"] > 1 else []
    parts += [f"virtual={g['virtual']}"] if g["virtual"] > 1 else []
    parts += ["sp=1"] if g["sp"] else []
    parts += [f"cp_comm={g['cp_comm']}"] if g["cp"] > 1 and g["cp_comm"] != "ring" else []
    return ",".join(parts)


def short(p):
    """A grid for the table: dp8 tp4 pp8 m64, and what is not the default (cp, ep, zero, sp, schedule)."""
    g = p["grid"]
    parts = [f"dp{g['dp']}", f"tp{g['tp']}", f"pp{g['pp']}"]
    parts += [f"cp{g['cp']}"] if g["cp"] > 1 else []
    parts += [f"ep{g['ep']}"] if g["ep"] > 1 else []
    parts += [f"zero{g['zero']}"] if g["zero"] else []
    parts += ["sp"] if g["sp"] else []
    parts += [f"m{g['micro']}"]
    parts += [g["schedule"]] if g["pp"] > 1 and g["schedule"] != "1f1b" else []
    parts += [f"v{g['virtual']}"] if g["virtual"] > 1 else []
    parts += [g["cp_comm"]] if g["cp"] > 1 and g["cp_comm"] != "ring" else []
    return " ".join(parts)


def inputs(args, m, hw, tr, skill):
    """What --json says the plans assume."""
    return {"model": {"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads or m.heads,
                      "ffn_hidden": m.ffn, "mlp": "swiglu" if m.ffn_hidden else "gelu", "seq_len": m.seq_len,
                      "vocab": m.vocab, "experts": m.experts, "top_k": m.top_k},
            "parameters": parameter_count(m), "batch_size": args.batch_size, "gpus": args.gpus,
            "gpu": {"name": hw.name, "peak_flops": hw.peak[tr.precision], "hbm_bytes": hw.hbm,
                    "hbm_bytes_per_second": hw.hbm_bandwidth, "gpus_per_node": hw.gpus_per_node,
                    "flash_attention_share_of_peak": hw.flash if not hw.cores else None,
                    "links": {"intra": hw.intra, "inter": hw.inter}},
            "efficiency": ({"model": "fitted", "gemm_share_of_peak": skill.gemm,
                            "elementwise_passes": skill.elementwise,
                            "fitted_to": sorted({r.source for r in published_runs()})} if isinstance(skill, Skill)
                           else {"model": "constant", "share_of_peak": skill}),
            "precision": tr.precision, "recompute": tr.recompute, "attention": tr.attention, "optimizer": tr.optimizer,
            "weights": tr.weights, "overlap": tr.overlap, "kernels": tr.kernels, "usable": args.usable,
            "hybrid": args.hybrid, "collectives": None if hw.cores else NCCL_NOTE}


def wrapped(words, width=120, indent="    "):
    """A shell command on lines of at most `width`, continued with backslashes."""
    lines, line = [], words[0]
    for word in words[1:]:
        if len(line) + 1 + len(word) + 2 > width:
            lines.append(line + " \\")
            line = indent + word
        else:
            line += " " + word
    return lines + [line]


TABLE = f"{'grid':26} {'GB/GPU':>6} {'weights':>7} {'grads':>5} {'optim':>5} {'acts':>5} {'bubble':>6} " \
        f"{'step s':>8} {'tok/s/GPU':>9} {'TFLOP/s':>7} {'MFU':>5} {'comm GB':>7}"


def print_plans(args, m, hw, tr, plans, skill):
    first = plans[0]["grid"]
    gpus = first["dp"] * first["tp"] * first["pp"] * first["cp"]
    print(f"{gpus} x {hw.name} | {tr.precision}, recompute {tr.recompute}, {tr.attention} attention, {tr.optimizer}"
          + (", hybrid_parallel.py's grids" if args.hybrid else ""))
    if isinstance(skill, Skill):
        print(f"step time: matrix products at {skill.gemm:.0%} of {hw.peak[tr.precision] / 1e12:g} TFLOP/s, "
              f"other kernels {skill.elementwise:.2f} passes over activations (plan.py --published)")
    else:
        print(f"step time: every FLOP at {skill:.0%} of {hw.rate(tr.precision, gpus) / 1e12:g} TFLOP/s"
              + (" a rank (calibrated)" if hw.cores else " (--efficiency)"))
    if not hw.cores:
        print(NCCL_NOTE)
    shape = f"{m.heads} heads" + (f" ({m.kv_heads} kv)" if m.kv_heads and m.kv_heads != m.heads else "")
    mlp = f", SwiGLU {m.ffn_hidden}" if m.ffn_hidden else ""
    experts = f", {m.experts} experts top-{m.top_k}" if m.experts > 1 else ""
    print(f"model: {m.layers} blocks x {m.hidden} hidden, {shape}{mlp}, seq {m.seq_len}, vocab {m.vocab}{experts}: "
          f"{parameter_count(m) / 1e9:.2f} B parameters")
    print(TABLE)
    for p in plans:
        mb, name = p["memory_bytes_per_gpu"], short(p)
        if len(name) > 26:        # a long grid on a line of its own, its figures under it
            print(name)
            name = ""
        print(f"{name:26} {mb['total'] / 1e9:6.1f} {mb['weights'] / 1e9:7.1f} {mb['gradients'] / 1e9:5.1f} "
              f"{mb['optimizer'] / 1e9:5.1f} {mb['activations'] / 1e9:5.1f} {p['bubble']:6.1%} "
              f"{p['step_seconds']:8.3f} {p['tokens_per_second_per_gpu']:9.0f} {p['tflops_per_gpu']:7.1f} "
              f"{p['mfu']:5.1%} {sum(p['bytes_per_step'].values()) / 1e9:7.2f}" + ("" if p["fits"] else " *"))
    if not all(p["fits"] for p in plans):
        print(f"* does not fit: more than {args.usable:.0%} of the GPU's {hw.hbm / 1e9:.1f} GB (--usable)")
    best = plans[0]
    terms = best["step_seconds_by_term"]
    for line in ("best, its step in s: " + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in terms.items()
                                                     if k != "total" and v > 0),
                 "best, GB it hands the network per step: " + ", ".join(f"{a} {b / 1e9:.2f}" for a, b in
                                                                       best["bytes_per_step"].items() if b)):
        print("\n".join(textwrap.wrap(line, 120, subsequent_indent="  ")))
    if hw.cores:
        return
    g, per_node = best["grid"], min(hw.gpus_per_node, gpus)
    print(f"best as a batch script ({describe(best)}):")
    print(f"  #SBATCH --nodes={-(-gpus // per_node)} --ntasks-per-node={per_node} --gpus-per-node={per_node} "
          f"--distribution=block:block")
    flags = ["srun python hybrid_parallel.py", f"--pp {g['pp']}", f"--dp {g['dp']}", f"--cp {g['cp']}",
             f"--tp {g['tp']}", f"--micro-batches {g['micro']}", f"--layers {m.layers}", f"--hidden {m.hidden}",
             f"--heads {m.heads}", f"--seq-len {m.seq_len}", f"--batch-size {args.batch_size}"]
    flags += [f"--experts {m.experts}", f"--top-k {m.top_k}", f"--ep {g['ep']}"] if m.experts > 1 else []
    flags += ["--zero-stage 1"] if g["zero"] == 1 else []
    flags += ["--sequence-parallel"] if g["sp"] else []
    flags += [f"--precision {tr.precision}", f"--recompute {tr.recompute}", "--no-check"]
    for line in wrapped(flags, width=118, indent="      "):
        print("  " + line)
    lacks = [what for what, on in ((f"ZeRO stage {g['zero']}", g["zero"] > 1),
                                   (f"the {g['schedule']} schedule", g["pp"] > 1 and g["schedule"] != "1f1b"),
                                   (f"cp_comm={g['cp_comm']}", g["cp"] > 1 and g["cp_comm"] != "ring"),
                                   (f"top-{m.top_k} routing", m.experts > 1 and m.top_k > 2),
                                   ("--kv-heads", bool(m.kv_heads) and m.kv_heads != m.heads),
                                   ("--ffn-hidden (SwiGLU)", bool(m.ffn_hidden)),
                                   (f"a vocabulary of {m.vocab} (it trains on 128 ASCII codes)", m.vocab != 128)) if on]
    if lacks:
        note = f"(hybrid_parallel.py does not run {', '.join(lacks)}: the plan's figures assume them)"
        print("\n".join(textwrap.wrap(note, 118, initial_indent="  ", subsequent_indent="   ")))


def print_published(rows):
    """The model against each published run, held out of the fit, beside a constant share of peak."""
    results = held_out(rows)
    print(f"{'published run':35} {'figure, per GPU':15} {'published':>9} {'plan.py':>8} {'error':>6} "
          f"{'constant':>8} {'error':>6}")
    short = {NARAYANAN: "Narayanan 2021", TORCHTITAN: "torchtitan", MEGATRON_CORE: "Megatron-Core"}
    for row, predicted, constant in results:
        print(f"{short[row.source] + ' ' + row.label:35} {row.unit:15} {row.value:9g} {predicted:8.1f} "
              f"{predicted / row.value - 1:+6.1%} {constant:8.1f} {constant / row.value - 1:+6.1%}")
    table = [(r, p, c) for r, p, c in results if r.source == NARAYANAN]
    if table:
        published = [r.value for r, _, _ in table]
        print(f"{NARAYANAN}: rank correlation with the published {spearman(published, [p for _, p, _ in table]):.2f} "
              f"(constant {spearman(published, [c for _, _, c in table]):.2f})")
    skill, share = fit(rows), fit_constant(rows)
    print(f"each row predicted by constants fitted to the other {len(rows) - 1}; fitted to all {len(rows)}:")
    print(f"  matrix products at {skill.gemm:.1%} of peak, other kernels {skill.elementwise:.2f} passes over the "
          f"activations; constant {share:.1%} of peak")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    try:
        args = parse_args(argv)
        if args.published:
            print_published(published_runs())
            return 0
        check_args(args)
        m = Model(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, args.experts, args.top_k,
                  kv_heads=args.kv_heads or 0, ffn_hidden=args.ffn_hidden or 0)
        tr = Training(args.precision, args.recompute, args.attention, args.optimizer,
                      "autocast" if args.hybrid else "master", args.overlap, kernels=args.kernels)
        hw, skill = hardware(args, m, tr)
        if args.grid:
            g = parse_grid(args.grid)
            check_grid(m, g, tr, args.batch_size, args.gpus, args.hybrid)
            args.gpus = g.gpus
            plans = [evaluate(m, g, tr, args.batch_size, hw, skill, args.usable)]
        else:
            if not args.gpus:
                raise PlanError("give --gpus N to search the grids, or --grid to evaluate one")
            if args.hybrid:
                why = hybrid_refusal(m, Grid(), tr)
                if why:
                    raise PlanError(why)
            plans, tried = search(m, tr, args.gpus, args.batch_size, hw, skill, args.usable, args.top, args.hybrid)
            if not tried:
                raise PlanError(f"no grid of {args.gpus} GPUs splits --batch-size {args.batch_size} and --heads "
                                f"{args.heads}; try a batch that {args.gpus} divides")
            if not plans:
                need = gpus_needed(m, tr, args.batch_size, hw, args.usable, args.hybrid)
                least = min(tried, key=lambda g: peak_memory(m, g, tr, args.batch_size))
                least = evaluate(m, least, tr, args.batch_size, hw, skill, args.usable)
                raise PlanError(f"no grid of {args.gpus} {args.gpu} GPUs fits: the least memory, "
                                f"{describe(least)}, needs {least['memory_bytes_per_gpu']['total'] / 1e9:.1f} GB a "
                                f"GPU of {args.usable * hw.hbm / 1e9:.1f} usable; "
                                + (f"it would need {need} GPUs" if need else "no number of GPUs fits it")
                                + (" (or --recompute full)" if args.recompute != "full" else ""))
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        if as_json:
            print(json.dumps({"error": str(e)}))
        return 2
    for p in plans:
        p["sequences_per_micro_batch"] = args.batch_size // p["grid"]["dp"] // p["grid"]["micro"]
    if args.json:
        print(json.dumps({"inputs": inputs(args, m, hw, tr, skill), "plans": plans}))
    else:
        print_plans(args, m, hw, tr, plans, skill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
