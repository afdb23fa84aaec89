"""The measurements of one MPI job: `mpirun -np N python bench/worker.py GROUP [flags]`.

bench/run.py launches this once per group and world size; it is not meant to be started by hand
(but can be, to look at one group). Each group holds cases: a strategy script run through its own
`main()` with `--json`, and the peers it is compared with (PyTorch's own implementation on gloo,
the bare collective). The cases take turns, one run of each per round, so that the machine's load
drifts over all of them alike. Every number is the median over rounds of a median over the steps
after the first, of the slowest rank, as the strategy scripts report theirs.

Rank 0 prints one JSON object as the last line of standard output: the job's layout (world size,
cores, threads, MPI library) and, per group, its network and batch ("config") and its "cases",
each {"label", "tags", "result"}, where a result holds the strategy's --json keys (numbers as
medians over rounds, the step times of every round in "step_time_s_rounds") or, for a case that
cannot run here, {"error": "one line saying why"}.
"""
import argparse
import collections
import contextlib
import ctypes
import datetime
import functools
import gc
import importlib
import inspect
import io
import json
import math
import os
import queue
import socket
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the strategy files, imported as modules
GLOO_TIMEOUT = datetime.timedelta(seconds=120)  # a peer that hangs fails instead of waiting forever


class CannotRun(Exception):
    """A case that cannot run in this setting; the message is the table's one line of why."""


# -----------------------------------------------------------------------------
# Setup: threads as the strategies set them, and a gloo group with its rendezvous from MPI
# -----------------------------------------------------------------------------
def node_layout(comm):
    """This rank's place among the ranks on its machine: (local rank, local ranks)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    layout = node.Get_rank(), node.Get_size()
    node.Free()
    return layout


def init_gloo(comm):
    """torch.distributed on gloo over the same ranks: rank 0's host and a free port, from MPI."""
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:  # a host that cannot resolve its own name: the job is on this machine
                host = "127.0.0.1"
            address = (host, s.getsockname()[1])
    else:
        address = None
    host, port = comm.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=GLOO_TIMEOUT)


def device_of(choice, local_rank):
    """The strategies' rule: rank r on cuda:(local rank % GPUs), or the CPU."""
    if choice == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -----------------------------------------------------------------------------
# Timing: the one loop every peer is timed with
# -----------------------------------------------------------------------------
def timed(comm, steps, step, device, warmup=1):
    """Run step(i) for i < steps; the slowest rank's median time of the steps after warm-up."""
    comm.Barrier()
    times, results = [], []
    for i in range(steps):
        start = time.perf_counter()
        results.append(step(i))
        sync(device)
        times.append(time.perf_counter() - start)
    return max(comm.allgather(statistics.median(times[warmup:] or times))), results


Case = collections.namedtuple("Case", "label tags run")  # tags: what the report selects it by


def as_the_peers(module, flags):
    """Our GPT files train the whole recipe by default (AdamW, the norm clipped, a cosine); their peers
    here train SGD (ZeRO's: AdamW) at a constant rate, unclipped, as every bench result was measured:
    ours are run so too, like for like. Flags given (the matrix's recipe) come after, and win."""
    if module == "data_parallel":
        return [*flags]
    sgd = [] if module == "sharded_data_parallel" else ["--optimizer", "sgd", "--lr", 0.1]
    return [*sgd, "--clip-grad", 0, "--lr-schedule", "constant", *flags]


def strategy(module, *flags, transport="mpi"):
    """Run a strategy file's main() in this process with --json; its JSON object (rank 0). With
    transport "gloo", main() is handed the job's GlooComm: the same script, its exchanges on gloo."""
    def run(ctx):
        if not (ROOT / f"{module}.py").is_file():
            raise CannotRun(f"{module}.py is not in this checkout yet")
        comm = ctx.comm
        if transport == "gloo":
            if ctx.device.type == "cuda":
                raise CannotRun("ours on gloo is measured on the CPU only (gloo sends no CUDA tensors point to point)")
            comm = gloo_comm(ctx)
        out = io.StringIO()
        argv = [*as_the_peers(module, flags), "--steps", ctx.args.steps, "--device", ctx.args.device,
                "--log-every", 10 ** 6, "--check" if ctx.args.check else "--no-check", "--json"]
        with contextlib.redirect_stdout(out):
            code = importlib.import_module(module).main([str(a) for a in argv], comm)
        lines = out.getvalue().strip().splitlines()
        try:
            result = json.loads(lines[-1]) if ctx.comm.Get_rank() == 0 else {}
        except (ValueError, IndexError):
            result = None
        if code == 1 and result is not None and ctx.args.check:  # ran, and the check failed
            return {**result, "check_passed": False}
        if code != 0 or result is None:
            raise RuntimeError(f"{module}.py {' '.join(map(str, flags))} exited {code}"
                               + (f": {lines[-1][:200]}" if lines else ""))
        return {**result, "check_passed": True} if ctx.args.check else result
    return run


def gloo_comm(ctx):
    """The job's GlooComm over ctx.comm, made once (every rank runs the same case at the same time)."""
    if getattr(ctx, "gloo", None) is None or ctx.gloo.comm != ctx.comm:  # on_first() copies ctx
        ctx.gloo = GlooComm(ctx.comm)
    return ctx.gloo


def ours_on_gloo(case, module, *flags):
    """The twin of one of our runs, its exchanges carried by gloo: ours and the peer on one transport."""
    return Case(f"{case.label} on gloo", {"kind": "on_gloo", "of": case.label, "gloo": True},
                strategy(module, *flags, transport="gloo"))


def defaults(module, world_size, *flags):
    """A strategy file's arguments from its defaults and these flags: the network and batch that
    its peers must use too."""
    if not (ROOT / f"{module}.py").is_file():
        raise CannotRun(f"{module}.py is not in this checkout yet")
    return importlib.import_module(module).parse_args([str(f) for f in as_the_peers(module, flags)], world_size)


# -----------------------------------------------------------------------------
# Ours on gloo: a communicator with mpi4py's buffer methods, its exchanges carried by gloo
# -----------------------------------------------------------------------------
# A rank that Tests a send, a receive or a reduce-scatter again within POLLING_S polls it: it waits
# (the scripts nap 1e-4 s between polls, and Test a send once an action, a reduce-scatter once a
# layer: milliseconds apart here). TESTS_BEFORE_A_WAITER Tests in all are taken for polling too,
# whatever their pace (a nap may last longer on a busy core).
POLLING_S, TESTS_BEFORE_A_WAITER = 1e-3, 1000
GLOO_OPS = ((MPI.SUM, dist.ReduceOp.SUM), (MPI.MAX, dist.ReduceOp.MAX), (MPI.MIN, dist.ReduceOp.MIN),
            (MPI.PROD, dist.ReduceOp.PRODUCT))  # mpi4py's operations are not hashable


def gloo_op(op):
    """gloo's reduction for an MPI one."""
    for mpi_op, gloo in GLOO_OPS:
        if op == mpi_op:
            return gloo
    raise NotImplementedError(f"the reduction {op} is not carried by gloo in this bench")


def gloo_group(comm, store=None, timeout=GLOO_TIMEOUT):
    """A gloo process group over the ranks of comm, its own, apart from torch.distributed's default
    group (so that any sub-communicator can have one): over `store`, or a TCPStore on rank 0's host
    and a free port that MPI tells the others. Built as torch.distributed builds the peers' gloo groups
    (the same constructor: gloo's default device and threads).
    Returns the group and its store, which must live as long as the group."""
    if store is None:
        if comm.Get_rank() == 0:
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:  # a host that cannot resolve its own name: the job is on this machine
                host = "127.0.0.1"
            store = dist.TCPStore(host, 0, comm.Get_size(), True, timeout=timeout, wait_for_workers=False)
            address = (host, store.port)
        else:
            address = None
        host, port = comm.bcast(address, root=0)
        if comm.Get_rank() != 0:
            store = dist.TCPStore(host, port, comm.Get_size(), False, timeout=timeout)
    return dist.ProcessGroupGloo(store, comm.Get_rank(), comm.Get_size(), timeout), store


def as_tensor(spec):
    """The tensor of an mpi4py buffer argument (a tensor, [tensor, datatype], [tensor, counts...]);
    a NumPy array or a bytes-like object as a tensor over the same memory."""
    x = spec[0] if isinstance(spec, (list, tuple)) else spec
    if torch.is_tensor(x):
        return x
    if hasattr(x, "__array_interface__"):
        return torch.from_numpy(x)
    return torch.frombuffer(x, dtype=torch.uint8)


def vector_counts(spec, size):
    """The counts of an Alltoallv buffer ([tensor, counts], [tensor, (counts, displacements)] or
    [tensor, counts, displacements]); gloo takes them packed, so displacements must be their sums."""
    counts, displacements = spec[1], spec[2] if len(spec) > 2 and hasattr(spec[2], "__len__") else None
    if isinstance(counts, tuple) and len(counts) == 2 and hasattr(counts[0], "__len__"):  # (counts, displacements)
        counts, displacements = counts
    counts = [int(c) for c in counts][:size]
    if displacements is not None and [int(d) for d in displacements][:size] != [sum(counts[:r]) for r in range(size)]:
        raise ValueError("Alltoallv on gloo: the displacements must be the running sums of the counts")
    return counts


class Waiters:
    """Daemon threads that wait on gloo works for GlooRequest.Test, each kept for the next work once
    its own is done: Thread.start() returns only once the new thread has run, which on a busy core
    is a scheduler's wait (a thread started per work cost 1F1B and interleaved at N = 4 on 2 cores
    about a tenth of their step).
    There is a thread for every work handed over and not yet done, so that one waiting on an early
    work never holds up a later one: the ranks may wait for them in any order."""

    def __init__(self):
        self.works, self.lock, self.idle = queue.SimpleQueue(), threading.Lock(), 0

    def hand_over(self, request):
        with self.lock:
            start, self.idle = self.idle == 0, max(self.idle - 1, 0)
        if start:
            threading.Thread(target=self.serve, daemon=True).start()
        self.works.put(request)

    def serve(self):
        while True:
            request = self.works.get()
            request.wait_on_thread()
            with self.lock:  # idle before it says done: the rank's next work finds it
                self.idle += 1
            request.done.set()


WAITERS = Waiters()


class GlooRequest(MPI.Request):
    """An mpi4py request (so that a strategy's counting wrapper times its Wait as MPI's) over a gloo
    work; holds the tensors until the work is done, and runs `then` (a copy out) once after it.

    Test tells a finished exchange without waiting for it. gloo's allreduce, broadcast and all-gather
    say they are done through is_completed(); its reduce-scatter, send and receive never do (torch
    2.13: only wait() ends them). For those (polled=False) a Test answers "not yet" until the rank
    polls (POLLING_S), then hands the work to WAITERS, whose thread marks it done:
      - the scripts Test a send once an action (the pipeline's, the hybrid's) or a reduce-scatter
        once a layer (ZeRO) to move MPICH on, which moves a message only inside MPI calls; gloo moves
        them on a thread of its own, and those Tests need no answer before the step's Wait. A waiter
        for each cost 1F1B and interleaved at N = 4 on 2 cores about a tenth of their step;
      - where ranks outnumber cores, the scripts' Wait (CountedRequest.Wait) polls with naps, as
        MPICH's Wait would spin on a core that a rank computing needs: a Test from it waits in
        gloo's wait(), which sleeps until the work is done. (Their collectives keep the naps:
        polling gloo's is_completed() took 3.9-4.2 ms an allreduce at N = 4 on 2 cores, wait() 6.5-6.9.)
      - a rank that polls otherwise is waiting too (their checks poll a send to rank 0): a waiter
        ends it. Polling a work that only wait() ends hung every bench job at N = 4 on 2 cores.
    A waiter is never wrong, only dear: which Tests get one decides the cost, not the result."""

    def __new__(cls, work, tensors=(), then=None, polled=True):
        request = super().__new__(cls)
        request.work, request.tensors, request.then, request.polled = work, tensors, then, polled
        request.tests, request.tested, request.done, request.failure = 0, -math.inf, None, None
        return request

    def wait_on_thread(self):
        try:
            self.work.wait()  # lets go of the GIL while it waits
        except Exception as e:  # raised again by Wait, on the rank's own thread
            self.failure = e

    def Test(self, status=None):
        if self.work is not None and not self.polled and self.done is None:
            if sys._getframe(1).f_code.co_name == "Wait":  # the scripts' CountedRequest.Wait: it waits
                self.Wait()
                return True
            now, self.tests = time.perf_counter(), self.tests + 1
            polled, self.tested = now - self.tested < POLLING_S or self.tests >= TESTS_BEFORE_A_WAITER, now
            if not polled:
                return False
            self.done = threading.Event()
            WAITERS.hand_over(self)
        if self.work is not None and (not self.done.is_set() if self.done else not self.work.is_completed()):
            return False
        self.Wait()  # once done: the tensors let go, the copy out made (a done request stays done)
        return True

    def Wait(self, status=None):
        if self.work is not None:
            if self.done is None:
                self.work.wait()
            else:  # wait() once only: a second one on a finished send or receive waits for another
                self.done.wait()
                if self.failure is not None:
                    raise self.failure
            self.work, self.tensors = None, ()
            if self.then is not None:
                self.then()


class GlooComm:
    """mpi4py's communicator with its buffer exchanges carried by torch.distributed's gloo: the
    strategy's collectives and messages (every call the scripts count: Allreduce, Iallreduce,
    Bcast, Ibcast, Allgather, Iallgather, Reduce_scatter_block, Ireduce_scatter_block, Alltoall,
    Alltoallv, Send, Recv, Isend, Irecv, Sendrecv) go to the gloo group of the same ranks, the one
    PyTorch's peers use. Everything else goes to MPI unchanged: the pickled objects of the check,
    the report and the stop signal, Barrier and Ibarrier, Gather of the check, the queries; those are
    outside the step's exchanges. A communicator split from it is carried by gloo too.

    Where MPI and gloo may differ: a sum over more than two ranks adds in each library's own order
    (MPICH's recursive halving, gloo's ring), so the last bit of a float can differ at N > 2, while
    at N = 2 (a + b = b + a) and in every exchange that only moves data the two agree bit for bit."""

    CARRIED = {"Allreduce", "Iallreduce", "Bcast", "Ibcast", "Allgather", "Iallgather", "Reduce_scatter_block",
               "Ireduce_scatter_block", "Alltoall", "Alltoallv", "Send", "Recv", "Isend", "Irecv", "Sendrecv"}
    REFUSED = {"Allgatherv", "Reduce_scatter", "Ialltoallv", "Create_cart", "Create"}  # not carried: no silent MPI

    def __init__(self, comm, store=None):
        self.comm = comm
        self.group, self.store = gloo_group(comm, store)

    def __getattr__(self, name):
        if name in self.REFUSED:
            raise NotImplementedError(f"{name} is not carried by gloo in this bench")
        return getattr(self.comm, name)

    # Collectives. op: an MPI reduction; the blocking calls are the non-blocking ones waited for.
    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        t = as_tensor(recvbuf)
        if sendbuf is not MPI.IN_PLACE:
            t.copy_(as_tensor(sendbuf))
        options = dist.AllreduceOptions()
        options.reduceOp = gloo_op(op)
        return GlooRequest(self.group.allreduce([t], options), (t,))

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        self.Iallreduce(sendbuf, recvbuf, op).Wait()

    def Ibcast(self, buf, root=0):
        t = as_tensor(buf)
        options = dist.BroadcastOptions()
        options.rootRank = root
        return GlooRequest(self.group.broadcast([t], options), (t,))

    def Bcast(self, buf, root=0):
        self.Ibcast(buf, root).Wait()

    def Iallgather(self, sendbuf, recvbuf):
        whole = as_tensor(recvbuf)
        part = whole.numel() // self.comm.Get_size()
        mine = whole.view(-1)[self.comm.Get_rank() * part:(self.comm.Get_rank() + 1) * part].clone() \
            if sendbuf is MPI.IN_PLACE else as_tensor(sendbuf).reshape(-1)
        return GlooRequest(self.group._allgather_base(whole.view(-1), mine), (whole, mine))

    def Allgather(self, sendbuf, recvbuf):
        self.Iallgather(sendbuf, recvbuf).Wait()

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        received = as_tensor(recvbuf)
        if sendbuf is MPI.IN_PLACE:  # the whole vector is in recvbuf; this rank's sum goes to its start
            whole = received.view(-1).clone()
            out = torch.empty(whole.numel() // self.comm.Get_size(), dtype=whole.dtype)

            def then():
                received.view(-1)[:out.numel()].copy_(out)
        else:
            whole, out, then = as_tensor(sendbuf).reshape(-1), received.view(-1), None
        options = dist.ReduceScatterOptions()
        options.reduceOp = gloo_op(op)
        return GlooRequest(self.group._reduce_scatter_base(out, whole, options), (whole, out), then, polled=False)

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        self.Ireduce_scatter_block(sendbuf, recvbuf, op).Wait()

    def Alltoall(self, sendbuf, recvbuf):
        send, received = as_tensor(sendbuf).reshape(-1), as_tensor(recvbuf).view(-1)
        self.group.alltoall_base(received, send, [], [], dist.AllToAllOptions()).wait()

    def Alltoallv(self, sendbuf, recvbuf):
        size = self.comm.Get_size()
        send, received = as_tensor(sendbuf).reshape(-1), as_tensor(recvbuf).view(-1)
        sent, taken = vector_counts(sendbuf, size), vector_counts(recvbuf, size)
        self.group.alltoall_base(received[:sum(taken)], send[:sum(sent)], taken, sent,
                                 dist.AllToAllOptions()).wait()

    # Messages: gloo matches them by (peer, tag) as MPI does.
    def Isend(self, buf, dest, tag=0):
        t = as_tensor(buf)
        return GlooRequest(self.group.send([t.view(-1)], dest, tag), (t,), polled=False)

    def Irecv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
        if source == MPI.ANY_SOURCE or tag == MPI.ANY_TAG:
            raise NotImplementedError("Irecv on gloo needs its source and tag")
        t = as_tensor(buf)
        return GlooRequest(self.group.recv([t.view(-1)], source, tag), (t,), polled=False)

    def Send(self, buf, dest, tag=0):
        self.Isend(buf, dest, tag).Wait()

    def Recv(self, buf, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
        self.Irecv(buf, source, tag).Wait()

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=MPI.ANY_SOURCE, recvtag=MPI.ANY_TAG,
                 status=None):
        sending = self.Isend(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag)
        sending.Wait()

    # A communicator split from this one has a gloo group of its own.
    def Split(self, color=0, key=0):
        sub = self.comm.Split(color, key)
        return sub if sub == MPI.COMM_NULL else GlooComm(sub)

    def Dup(self):
        return GlooComm(self.comm.Dup())

    def Free(self):
        self.comm.Free()


# -----------------------------------------------------------------------------
# Bare collectives: a strategy's step written down at the MPI call, replayed on MPI and on gloo
# -----------------------------------------------------------------------------
# mpi4py's buffer methods, by the kind of exchange they are; gloo's counterpart of each below
KINDS = {"Allreduce": "allreduce", "Iallreduce": "allreduce", "Bcast": "bcast", "Ibcast": "bcast",
         "Allgather": "allgather", "Iallgather": "allgather", "Reduce_scatter_block": "reduce_scatter",
         "Ireduce_scatter_block": "reduce_scatter", "Alltoall": "alltoall", "Alltoallv": "alltoallv",
         "Ialltoallv": "alltoallv", "Send": "send", "Isend": "send", "Recv": "recv", "Irecv": "recv"}
SPLITS = ("Split", "Split_type", "Dup", "Create", "Create_cart")  # calls that return a communicator
RECORDED = {}  # (module, flags, world size) -> this rank's calls of one step, recorded once per job
BARE_SECONDS = 0.3  # both transports in turns, repeated for about this long (at least 3 times each)


def tensor_of(spec):
    """The tensor in an mpi4py buffer argument: the tensor itself or the first of [tensor, counts...]."""
    return spec[0] if isinstance(spec, (list, tuple)) else spec


def counts_of(spec, size):
    """The per-rank counts (elements) of an Alltoallv buffer [tensor, (counts, offsets)]."""
    counts = spec[1][0] if isinstance(spec[1], (list, tuple)) and isinstance(spec[1][0], (list, tuple)) \
        else spec[1]
    return [int(c) for c in counts][:size]


class RecordingComm:
    """mpi4py's communicator, handed to a strategy's main() in place of the job's: every call goes
    to MPI unchanged, and each buffer exchange is written down on the way (its kind, dtype, element
    counts, peer, tag and the size of its communicator); a communicator split from it records too."""

    def __init__(self, comm, log):
        self.comm, self.log = comm, log

    def __getattr__(self, name):
        call = getattr(self.comm, name)
        if name in SPLITS:
            return lambda *a, **k: (lambda c: c if c == MPI.COMM_NULL else RecordingComm(c, self.log))(call(*a, **k))
        if name not in KINDS:
            return call

        def recorded(*args, **kwargs):
            kind, size = KINDS[name], self.comm.Get_size()
            entry = {"kind": kind, "size": size}
            if kind in ("send", "recv"):
                t = args[0]
                entry["peer"] = kwargs.get("dest", kwargs.get("source", args[1] if len(args) > 1 else None))
                entry["tag"] = kwargs.get("tag", args[2] if len(args) > 2 else 0)
            elif kind == "alltoallv":
                t = tensor_of(args[0])
                entry["counts"] = [counts_of(args[0], size), counts_of(args[1], size)]
            else:
                t = tensor_of(args[1] if args[0] is MPI.IN_PLACE else args[0])
                if kind in ("allgather", "alltoall"):  # the whole vector: the receive buffer
                    t = tensor_of(args[1])
                if kind == "bcast":
                    entry["root"] = kwargs.get("root", args[1] if len(args) > 1 else 0)
            entry.update(dtype=str(t.dtype).removeprefix("torch."), numel=t.numel())
            self.log.append(entry)
            return call(*args, **kwargs)
        return recorded


def record_step(ctx, module, flags):
    """Run the strategy for 3 steps with its exchanges written down, and keep those of its last
    step (between the last two of its timeline's step ends): the collectives and messages one
    steady step hands MPI, on this rank, in order."""
    key = (module, tuple(map(str, flags)), ctx.comm.Get_size())
    if key in RECORDED:
        return RECORDED[key]
    m = importlib.import_module(module)
    log, marks = [], []
    step_record = m.Timeline.step_record

    def marked(self, start):
        marks.append(len(log))
        return step_record(self, start)
    m.Timeline.step_record = marked
    try:
        argv = [*map(str, as_the_peers(module, flags)), "--steps", "3", "--device", ctx.args.device,
                "--log-every", str(10 ** 6), "--no-check"]
        with contextlib.redirect_stdout(io.StringIO()):
            code = m.main(argv, RecordingComm(ctx.comm, log))
    finally:
        m.Timeline.step_record = step_record
    if code != 0 or len(marks) < 3:
        raise RuntimeError(f"{module}.py {' '.join(map(str, flags))}: the recording run exited {code}")
    calls = log[marks[-2]:marks[-1]]
    if any(1 < c["size"] < ctx.comm.Get_size() for c in calls):
        raise CannotRun("exchanges on sub-communicators are not replayed")
    RECORDED[key] = [c for c in calls if c["size"] > 1]  # a communicator of one rank moves nothing
    return RECORDED[key]


def replay_buffers(calls):
    """The buffers of a replay, made once: zeros of each call's dtype and sizes."""
    def zeros(n, dtype):
        return torch.zeros(n, dtype=getattr(torch, dtype))
    out = []
    for c in calls:
        n, size = c["numel"], c["size"]
        if c["kind"] == "allgather":
            out.append((zeros(n // size, c["dtype"]), zeros(n, c["dtype"])))
        elif c["kind"] == "reduce_scatter":
            out.append((zeros(n, c["dtype"]), zeros(n // size, c["dtype"])))
        elif c["kind"] == "alltoallv":
            out.append((zeros(sum(c["counts"][0]), c["dtype"]), zeros(sum(c["counts"][1]), c["dtype"])))
        elif c["kind"] == "alltoall":
            out.append((zeros(n, c["dtype"]), zeros(n, c["dtype"])))
        else:
            out.append((zeros(n, c["dtype"]),))
    return out


def replay_mpi(comm, calls, buffers):
    """The step's exchanges on MPI, each blocking collective back to back; the messages posted as
    Isend/Irecv in their order and all waited for at the end (so no order can deadlock)."""
    requests = []
    for c, b in zip(calls, buffers):
        kind = c["kind"]
        if kind == "allreduce":
            comm.Allreduce(MPI.IN_PLACE, b[0], op=MPI.SUM)
        elif kind == "bcast":
            comm.Bcast(b[0], root=c["root"])
        elif kind == "allgather":
            comm.Allgather(b[0], b[1])
        elif kind == "reduce_scatter":
            comm.Reduce_scatter_block(b[0], b[1], op=MPI.SUM)
        elif kind == "alltoall":
            comm.Alltoall(b[0], b[1])
        elif kind == "alltoallv":
            comm.Alltoallv([b[0], c["counts"][0]], [b[1], c["counts"][1]])
        elif kind == "send":
            requests.append(comm.Isend(b[0], dest=c["peer"], tag=c["tag"]))
        else:
            requests.append(comm.Irecv(b[0], source=c["peer"], tag=c["tag"]))
    MPI.Request.Waitall(requests)


def replay_gloo(calls, buffers):
    """The same exchanges through torch.distributed on gloo, the peers' transport."""
    requests = []
    for c, b in zip(calls, buffers):
        kind = c["kind"]
        if kind == "allreduce":
            dist.all_reduce(b[0])
        elif kind == "bcast":
            dist.broadcast(b[0], src=c["root"])
        elif kind == "allgather":
            dist.all_gather_single(b[1], b[0])
        elif kind == "reduce_scatter":
            dist.reduce_scatter_single(b[1], b[0])
        elif kind == "alltoall":
            dist.all_to_all_single(b[1], b[0])
        elif kind == "alltoallv":
            dist.all_to_all_single(b[1], b[0], c["counts"][1], c["counts"][0])
        elif kind == "send":
            requests.append(dist.isend(b[0], c["peer"], tag=c["tag"]))
        else:
            requests.append(dist.irecv(b[0], c["peer"], tag=c["tag"]))
    for r in requests:
        r.wait()


def bytes_written():
    """Bytes this process has handed to write() and writev(): gloo's sockets, on Linux (MPICH's
    shared memory writes none); None where /proc/self/io is missing."""
    try:
        return next(int(line.split()[1]) for line in open("/proc/self/io") if line.startswith("wchar"))
    except (OSError, StopIteration):
        return None


def bare_both(comm, calls, device, seconds=BARE_SECONDS):
    """The calls replayed bare on MPI and on gloo, alternately, as many times as fit in about
    `seconds` (at least 3 after one warm-up of each); per transport the slowest rank's median,
    and the bytes gloo wrote per replay (mean over ranks)."""
    buffers = replay_buffers(calls)
    comm.Barrier()
    began = time.perf_counter()
    replay_mpi(comm, calls, buffers), replay_gloo(calls, buffers)  # warm-up: connections, pages
    once = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
    reps = max(3, min(200, int(seconds / max(once, 1e-6))))
    times, written = {"mpi": [], "gloo": []}, []
    for _ in range(reps):
        comm.Barrier()
        start = time.perf_counter()
        replay_mpi(comm, calls, buffers)
        times["mpi"].append(time.perf_counter() - start)
        comm.Barrier()
        start, before = time.perf_counter(), bytes_written()
        replay_gloo(calls, buffers)
        times["gloo"].append(time.perf_counter() - start)
        after = bytes_written()
        if before is not None and after is not None:
            written.append(after - before)
    medians = {k: max(comm.allgather(statistics.median(v))) for k, v in times.items()}
    wrote = comm.allgather(statistics.median(written) if written else None)
    return {"bare_mpi_s": medians["mpi"], "bare_gloo_s": medians["gloo"],
            "gloo_bytes_written": None if None in wrote else sum(wrote) / len(wrote), "reps": reps}


def kinds_summary(calls):
    """{kind: [calls, bytes]} of one step on this rank; a message counted once, at its sender."""
    out = {}
    for c in calls:
        if c["kind"] == "recv":
            continue
        n = sum(c["counts"][0]) if c["kind"] == "alltoallv" else c["numel"]
        entry = out.setdefault(c["kind"], [0, 0])
        entry[0] += 1
        entry[1] += n * torch.empty((), dtype=getattr(torch, c["dtype"])).element_size()
    return out


def bare_step(module, *flags):
    """The case of a strategy's bare exchanges: its steady step's collectives and messages, as it
    hands them to MPI (recorded once per job), replayed bare on MPI and on gloo."""
    def run(ctx):
        if not (ROOT / f"{module}.py").is_file():
            raise CannotRun(f"{module}.py is not in this checkout yet")
        if ctx.device.type == "cuda":
            raise CannotRun("bare replays are measured on the CPU only")
        calls = record_step(ctx, module, flags)
        kinds = collections.Counter()
        for summary in ctx.comm.allgather(kinds_summary(calls)):  # bytes: the most any rank sends
            for k, (n, b) in summary.items():
                kinds[k] = max(kinds[k], b)
        calls_per_kind = {k: max(s.get(k, [0])[0] for s in ctx.comm.allgather(kinds_summary(calls)))
                          for k in kinds}
        result = bare_both(ctx.comm, calls, ctx.device, ctx.args.bare_seconds)
        return {**result, "kinds": {k: [calls_per_kind[k], kinds[k]] for k in sorted(kinds)}}
    return run


def bare_kind(kind, nbytes):
    """One collective of `kind` on a float32 vector of nbytes (the whole vector: an all-gather's
    output, a reduce-scatter's input), bare on MPI and on gloo; a message goes from each even rank
    to the next rank."""
    def run(ctx):
        n, rank, size = nbytes // 4, ctx.comm.Get_rank(), ctx.comm.Get_size()
        n -= n % size
        entry = {"kind": kind, "size": size, "dtype": "float32", "numel": n}
        if kind == "alltoallv":
            entry["counts"] = [[n // size] * size] * 2
        if kind == "bcast":
            entry["root"] = 0
        if kind == "sendrecv":  # ranks in pairs; an odd last rank sits out
            pair = rank ^ 1
            calls = [] if pair >= size else [{**entry, "kind": "send" if rank % 2 == 0 else "recv",
                                              "peer": pair, "tag": 7}]
        else:
            calls = [entry]
        return {**bare_both(ctx.comm, calls, ctx.device, ctx.args.bare_seconds), "bytes": n * 4}
    return run


TRANSPORT_BYTES = 1 << 20  # one size for every kind: between the toy models' vectors and the larger GPT's
TRANSPORT_KINDS = ("allreduce", "reduce_scatter", "allgather", "bcast", "alltoall", "alltoallv", "sendrecv")


def transport_cases(ctx):
    """Every kind of exchange the strategies use, at one size, bare on both transports; and the
    steps of the strategies without a peer of their own (context and expert parallelism) replayed."""
    n = ctx.comm.Get_size()
    cases = [Case(f"{kind}, {TRANSPORT_BYTES / 2 ** 20:g} MiB", {"kind": "bare", "op": kind, "gloo": True},
                  bare_kind(kind, TRANSPORT_BYTES)) for kind in TRANSPORT_KINDS]
    return cases + [
        Case("context_parallel.py (ring, zigzag): one step's exchanges",
             {"kind": "bare", "strategy": "context_parallel", "gloo": True}, bare_step("context_parallel")),
        Case(f"expert_parallel.py --ep {n}: one step's exchanges",
             {"kind": "bare", "strategy": "expert_parallel", "gloo": True}, bare_step("expert_parallel", "--ep", n))]


# -----------------------------------------------------------------------------
# Data parallelism: data_parallel.py, PyTorch DDP on gloo, and the bare allreduce
# -----------------------------------------------------------------------------
def lenet_training(ctx, wrap):
    """data_parallel.py's default training (LeNet, SGD, this rank's slice of each global batch)
    with the model wrapped by wrap(model); its step time and the losses of the global batch."""
    dp = importlib.import_module("data_parallel")
    a, comm, device = defaults("data_parallel", ctx.comm.Get_size()), ctx.comm, ctx.device
    meter = dp.PeakMemory(device)  # the peak, measured as the strategy scripts measure theirs
    model = wrap(dp.build_model(a.seed, device))
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)

    def step(i):
        images, labels = dp.make_batch(a.seed, i, a.batch_size)
        x, y = dp.slice_of(images.to(device), labels.to(device), comm.Get_rank(), comm.Get_size())
        optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    meter.reset()
    seconds, losses = timed(comm, ctx.args.steps, step, device)
    meter.stop()
    losses = [sum(ls) / comm.Get_size() for ls in zip(*comm.allgather(losses))]
    return {"step_time_s": seconds, "losses": losses, "peak_memory_bytes_per_rank": comm.allgather(meter.bytes),
            **ddp_buckets(model)}


def ddp_buckets(model):
    """{"buckets": the number of buckets DDP allreduces a step} of a DDP model (after the rebuild
    of its first step), else {}."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(model, DistributedDataParallel):
        return {}
    data = model._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return {"buckets": len(str(sizes).split())} if sizes else {}


def ddp(bucket_mb=None):
    """PyTorch DistributedDataParallel on gloo with data_parallel.py's bucket size: its default 25 MB
    (DDP's default too: for this LeNet one bucket), or `bucket_mb` as --bucket-mb sets ours; the
    gradients views into the buckets (gradient_as_bucket_view), and no buffer broadcast: BatchNorm
    statistics stay per rank, as in data_parallel.py (the replicas start from the same seed, so
    nothing needs syncing). No comm hook: DDP's own allreduce, in C++."""
    def run(ctx):
        from torch.nn.parallel import DistributedDataParallel
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        per_rank_bn = ({"forward_sync_buffers": False}
                       if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                       else {"broadcast_buffers": False})
        size = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
        return lenet_training(ctx, lambda m: DistributedDataParallel(m, device_ids=ids, gradient_as_bucket_view=True,
                                                                     **per_rank_bn, **size))
    return run


def no_exchange(ctx):
    """The same training with no exchange at all, every rank at once: compute alone, in the
    same process layout. The step time of a perfectly hidden exchange."""
    return lenet_training(ctx, lambda m: m)


def gradient_buffer():
    """A float32 buffer of as many numbers as the LeNet has parameters: the gradient bytes G."""
    dp = importlib.import_module("data_parallel")
    return torch.zeros(sum(p.numel() for p in dp.build_model(0, torch.device("cpu")).parameters()))


def mpi_allreduce(ctx):
    """The limit: one blocking MPI Allreduce of the gradient bytes, back to back; in GPU memory
    where the library reads it (data_parallel.py's test of CUDA-awareness), else host memory."""
    buf = gradient_buffer()
    if ctx.device.type == "cuda" and importlib.import_module("data_parallel").mpi_cuda_aware(ctx.comm):
        buf = buf.to(ctx.device)
    seconds, _ = timed(ctx.comm, ctx.args.collective_reps,
                       lambda i: ctx.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), ctx.device, warmup=5)
    return {"step_time_s": seconds, "bytes": buf.numel() * buf.element_size()}


def gloo_allreduce(ctx):
    """The same bytes through gloo's allreduce: the limit of DDP's transport."""
    buf = gradient_buffer()
    seconds, _ = timed(ctx.comm, ctx.args.collective_reps, lambda i: dist.all_reduce(buf),
                       ctx.device, warmup=5)
    return {"step_time_s": seconds, "bytes": buf.numel() * buf.element_size()}


def bare_of(case, module, *flags):
    """The case of `case`'s bare exchanges: its step's collectives replayed on both transports."""
    return Case(f"{case.label}: its step's exchanges bare", {"kind": "bare", "of": case.label, "gloo": True},
                bare_step(module, *flags))


def data_parallel_cases(ctx):
    small = ctx.args.small_bucket_mb
    dp = "data_parallel"
    cases = [
        Case("data_parallel.py", {"kind": "strategy", "strategy": dp, "variant": "default", "scaling": True},
             strategy(dp)),
        Case(f"data_parallel.py --bucket-mb {small:g}",
             {"kind": "strategy", "strategy": dp, "variant": "small"},
             strategy(dp, "--bucket-mb", small)),
        Case("data_parallel.py --no-overlap", {"kind": "strategy", "strategy": dp, "variant": "no_overlap"},
             strategy(dp, "--no-overlap")),
        Case("PyTorch DDP (gloo)", {"kind": "peer", "variant": "ddp", "gloo": True}, ddp()),
        Case(f"PyTorch DDP (gloo), bucket_cap_mb {small:g}", {"kind": "peer", "variant": "ddp_small", "gloo": True},
             ddp(small)),
        Case("no exchange (compute alone)", {"kind": "floor"}, no_exchange),
        Case("bare MPI Allreduce of the gradients", {"kind": "limit", "variant": "mpi"}, mpi_allreduce),
        Case("bare gloo allreduce of the gradients", {"kind": "limit", "variant": "gloo", "gloo": True},
             gloo_allreduce),
    ]
    compared = [(cases[0], ()), (cases[1], ("--bucket-mb", small)), (cases[2], ("--no-overlap",))]
    return (cases + [bare_of(c, dp, *flags) for c, flags in compared]
            + [ours_on_gloo(c, dp, *flags) for c, flags in compared])


# -----------------------------------------------------------------------------
# Pipeline and model parallelism: both schedules, a range of M; torch.distributed.pipelining
# -----------------------------------------------------------------------------
# torch.distributed.pipelining's schedules, by the placement of their stages: one per rank, round
# robin over two chunks per rank, or a V (down the ranks and back up), as pipeline_parallel.py's
# schedules of the same name place them.
TORCH_SCHEDULES = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b",
                   "ScheduleInterleaved1F1B": "interleaved", "ScheduleInterleavedZeroBubble": "interleaved",
                   "ScheduleZBVZeroBubble": "zbv"}
PEER_TIMEOUT = datetime.timedelta(seconds=20)  # a pipelining peer's sends and receives: a hang fails in this


def torch_pipeline(schedule, m, network=None):
    """torch.distributed.pipelining's schedule on gloo, with pipeline_parallel.py's stages (the
    same cut of the same model, built by its build_stage), batch, SGD and loss. Its sends and
    receives go through a group of their own with a short timeout: a schedule that hangs on gloo
    fails with the message of the receive that never completed, and the job goes on."""
    def run(ctx):
        from torch.distributed import pipelining
        pp = importlib.import_module("pipeline_parallel")
        a = defaults("pipeline_parallel", ctx.comm.Get_size(), *(PP_NETWORK if network is None else network))
        comm, device = ctx.comm, ctx.device
        rank, n = comm.Get_rank(), comm.Get_size()
        if ctx.device.type == "cuda":
            raise CannotRun("gloo sends no CUDA tensors point to point, and NCCL refuses two ranks "
                            "on one GPU")
        if not hasattr(pipelining, schedule):
            raise CannotRun(f"torch {torch.__version__} has no {schedule}")
        ours = TORCH_SCHEDULES[schedule]
        ranks = [pp.stage_rank(ours, n, s) for s in range(n * pp.chunks_of(ours, 2))]
        meter = pp.PeakMemory(device)  # the peak, measured as the strategy scripts measure theirs
        chunks = pp.build_stage(a, ranks, rank, device, split_backward=False)
        mine = [s for s in range(len(ranks)) if ranks[s] == rank]
        group = dist.new_group(backend="gloo", timeout=PEER_TIMEOUT)
        try:
            stages = [pipelining.PipelineStage(chunk, s, len(ranks), device, group=group)
                      for chunk, s in zip(chunks, mine)]
            schedule_class = getattr(pipelining, schedule)
            loss = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
            runner = schedule_class(stages if len(ranks) > n else stages[0], n_microbatches=m,
                                    loss_fn=loss)
            optimizer = torch.optim.SGD(chunks.parameters(), lr=a.lr, momentum=0.9)

            failed = []  # a rank whose step failed skips the rest, so that every rank gets to the end

            def step(i):
                if failed:
                    return None
                x, y = (t.to(device) for t in pp.make_batch(a.seed, i, a.batch_size, a.seq_len))
                optimizer.zero_grad(set_to_none=False)
                losses = []
                inputs = (x,) if ranks[0] == rank else ()
                targets = {"target": y, "losses": losses} if ranks[-1] == rank else {}
                try:
                    runner.step(*inputs, **targets)
                except Exception as e:  # noqa: BLE001 (told to every rank below, then raised)
                    traceback.print_exc(file=sys.stderr)
                    failed.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                    return None
                optimizer.step()
                return sum(loss.item() for loss in losses) / m

            meter.reset()
            seconds, losses = timed(comm, ctx.args.steps, step, device)
            meter.stop()
            errors = [e for e in comm.allgather(failed[0] if failed else None) if e]
            if errors:
                hung = [e for e in errors if "timed out" in e.lower() or "timeout" in e.lower()]
                raise CannotRun(f"hangs on gloo: a receive waited {PEER_TIMEOUT.seconds} s for a message "
                                f"that never came ({hung[0]})" if hung else errors[0])
        finally:
            dist.destroy_process_group(group)
        return {"step_time_s": seconds, "losses": comm.bcast(losses, root=ranks[-1]),
                "peak_memory_bytes_per_rank": comm.allgather(meter.bytes)}
    return run


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")  # pipeline_parallel.py's, in its order
# 8 blocks rather than the scripts' 4, so that the 2N stages of interleaved and zbv hold a block
# each at N = 4 and every schedule is measured on stages of equal cost, as its theory assumes.
PP_NETWORK = ("--layers", 8)


def micro_batches(args, n):
    """The values of M: --micro-batches, or N, 2N and 4N, so that interleaved's groups of N fit."""
    return args.micro_batches or [n, 2 * n, 4 * n]


def pipeline_cases(ctx):
    """Every schedule of pipeline_parallel.py at each M (interleaved with 2 chunks per rank, where
    M is a multiple of N), model_parallel.py, and torch.distributed.pipelining's schedules at the
    largest M, placed as ours of the same name."""
    pp, n = "pipeline_parallel", ctx.comm.Get_size()
    ms = micro_batches(ctx.args, n)
    torch_m, scaling_m = max(ms), 8 if 8 in ms else max(ms)
    cases = []
    for m in ms:
        for s in PIPELINE_SCHEDULES:
            if s == "interleaved" and m % n:
                continue
            flags = ("--virtual-stages", 2) if s == "interleaved" else ()
            cases.append(Case(f"pipeline_parallel.py --schedule {s}{' --virtual-stages 2' * bool(flags)} "
                              f"--micro-batches {m}",
                              {"kind": "strategy", "strategy": pp, "schedule": s, "m": m,
                               "scaling": s == "1f1b" and m == scaling_m},
                              strategy(pp, *PP_NETWORK, "--schedule", s, *flags, "--micro-batches", m)))
    cases.append(Case("model_parallel.py",
                      {"kind": "strategy", "strategy": "model_parallel", "scaling": True},
                      strategy("model_parallel", *PP_NETWORK)))
    for s in PIPELINE_SCHEDULES:  # at torch's M: the bare exchanges of those torch has too; all five on gloo,
        compared = next((c for c in cases if c.tags.get("schedule") == s and c.tags["m"] == torch_m), None)
        if compared:  # so that the best of ours on gloo meets the best of torch's
            flags = (*PP_NETWORK, "--schedule", s, *(("--virtual-stages", 2) if s == "interleaved" else ()),
                     "--micro-batches", torch_m)
            if s in TORCH_SCHEDULES.values():
                cases.append(bare_of(compared, pp, *flags))
            cases.append(ours_on_gloo(compared, pp, *flags))
    for name, ours in TORCH_SCHEDULES.items():
        # The zero-bubble schedule of torch with two chunks per rank is not ours (zb-h1 has one).
        same = None if name == "ScheduleInterleavedZeroBubble" else ours
        cases.append(Case(f"torch.distributed.pipelining {name}, M = {torch_m}",
                          {"kind": "peer", "schedule": same, "torch": name, "placement": ours,
                           "m": torch_m, "gloo": True},
                          torch_pipeline(name, torch_m)))
    return cases


# -----------------------------------------------------------------------------
# Tensor parallelism: tensor_parallel.py and torch.distributed.tensor.parallel
# -----------------------------------------------------------------------------
def torch_tensor_parallel(sequence_parallel=False, network=()):
    """tensor_parallel.py's network and batch under PyTorch's tensor parallelism on gloo:
    ColwiseParallel for qkv and fc1, RowwiseParallel for proj and fc2, the vocabulary split in
    the embedding (RowwiseParallel) and the head (ColwiseParallel with loss_parallel), as
    tensor_parallel.py splits them. With sequence_parallel, torch's SequenceParallel on the
    LayerNorms and the stream cut along the sequence between the parallel regions, as
    tensor_parallel.py --sequence-parallel cuts it: the embedding and the row-parallel layers
    reduce-scatter (Shard(1)), the column-parallel ones gather their input, the positions added at
    this rank's offsets."""
    def run(ctx):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       loss_parallel, parallelize_module)
        tp = importlib.import_module("tensor_parallel")
        comm, device, n, rank = ctx.comm, ctx.device, ctx.comm.Get_size(), ctx.comm.Get_rank()
        a = defaults("tensor_parallel", n, *network)
        if a.heads % n or tp.VOCAB % n:
            raise CannotRun(f"{a.heads} heads and {tp.VOCAB} tokens do not split into {n} equal parts")
        if sequence_parallel and a.seq_len % n:
            raise CannotRun(f"{a.seq_len} positions do not split into {n} equal parts")
        meter = tp.PeakMemory(device)  # the peak, measured as the strategy scripts measure theirs
        model = tp.build_model(a, device)
        # The fused qkv weight holds all queries, then all keys, then all values. A contiguous 1/N of
        # its rows (what ColwiseParallel gives a rank) must hold the queries, keys and values of the
        # same heads: reorder the rows, the same network written in another order.
        order = torch.arange(3 * a.hidden).view(3, n, a.hidden // n).transpose(0, 1).reshape(-1)
        stream = Shard(1) if sequence_parallel else Replicate()  # the stream between the regions
        plan = {"tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
                "out": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)}
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        with torch.no_grad():
            for i, block in enumerate(model.blocks):
                block.qkv.weight.copy_(block.qkv.weight[order.to(device)])
                block.qkv.bias.copy_(block.qkv.bias[order.to(device)])
                block.heads = a.heads // n  # the heads of this rank's slice
                plan.update({f"blocks.{i}.qkv": ColwiseParallel(input_layouts=stream),
                             f"blocks.{i}.proj": RowwiseParallel(output_layouts=stream),
                             f"blocks.{i}.fc1": ColwiseParallel(input_layouts=stream),
                             f"blocks.{i}.fc2": RowwiseParallel(output_layouts=stream)})
                if sequence_parallel:
                    plan.update({f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.ln2": SequenceParallel()})
        model = parallelize_module(model, init_device_mesh(device.type, (n,)), plan)
        if sequence_parallel:  # this rank's positions are its slice of the sequence
            def forward(idx):
                t = idx.size(1) // n
                x = model.tokens(idx) + model.positions(torch.arange(rank * t, (rank + 1) * t, device=idx.device))
                for block in model.blocks:
                    x = block(x)
                return model.out(model.norm(x))
            model.forward = forward
        optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)

        def step(i):
            x, y = (t.to(device) for t in tp.make_batch(a.seed, i, a.batch_size, a.seq_len))
            optimizer.zero_grad(set_to_none=False)
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
            if sequence_parallel:  # a plain parameter that saw this rank's positions only: summed by hand
                dist.all_reduce(model.positions.weight.grad)
            optimizer.step()
            return loss.full_tensor().item()

        meter.reset()
        seconds, losses = timed(comm, ctx.args.steps, step, device)
        meter.stop()
        return {"step_time_s": seconds, "losses": losses, "peak_memory_bytes_per_rank": comm.allgather(meter.bytes)}
    return run


def tensor_cases(ctx):
    tp = "tensor_parallel"
    cases = [Case(f"{tp}.py", {"kind": "strategy", "strategy": tp, "mode": "plain", "scaling": True},
                 strategy(tp, "--sample-chars", 0)),
            Case(f"{tp}.py --sequence-parallel", {"kind": "strategy", "strategy": tp, "mode": "sequence_parallel"},
                 strategy(tp, "--sample-chars", 0, "--sequence-parallel")),
            Case(f"{tp}.py --sequence-parallel --no-overlap",
                 {"kind": "strategy", "strategy": tp, "mode": "sequence_parallel", "overlap": False},
                 strategy(tp, "--sample-chars", 0, "--sequence-parallel", "--no-overlap")),
            Case("torch.distributed.tensor.parallel (DTensor, eager)", {"kind": "peer", "mode": "plain", "gloo": True},
                 torch_tensor_parallel()),
            Case("torch.distributed.tensor.parallel with SequenceParallel (DTensor, eager)",
                 {"kind": "peer", "mode": "sequence_parallel", "gloo": True}, torch_tensor_parallel(True))]
    compared = [(cases[0], ("--sample-chars", 0)), (cases[1], ("--sample-chars", 0, "--sequence-parallel"))]
    return (cases + [bare_of(c, tp, *flags) for c, flags in compared]
            + [ours_on_gloo(c, tp, *flags) for c, flags in compared])


# -----------------------------------------------------------------------------
# Sharded data parallelism (ZeRO): sharded_data_parallel.py, ZeroRedundancyOptimizer and FSDP2
# -----------------------------------------------------------------------------
def held_bytes(tensors):
    """Bytes of the storages behind these tensors, each storage once, as sharded_data_parallel.py
    measures its own; of a DTensor (FSDP2's shards) the storage of this rank's local part."""
    from torch.distributed.tensor import DTensor
    storages = {}
    with torch.no_grad():
        for t in tensors:
            if t is None:
                continue
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(n for pointer, n in storages.items() if pointer)


@contextlib.contextmanager
def counted_collectives():
    """Count the bytes handed to torch.distributed's collectives by the Python code that calls
    them (FSDP2, ZeroRedundancyOptimizer, the DDP comm hook below): the whole vector of each call,
    as sharded_data_parallel.py counts its own (an all-gather's output, a reduce-scatter's input)."""
    counts = collections.Counter()
    tensor_of = {"all_reduce": lambda *a, **k: k.get("tensor", a[0] if a else None),
                 "broadcast": lambda *a, **k: k.get("tensor", a[0] if a else None),
                 "all_gather_single": lambda *a, **k: k.get("output_tensor", a[0] if a else None),
                 "reduce_scatter_single": lambda *a, **k: k.get("input", a[1] if len(a) > 1 else None)}
    originals = {name: getattr(dist, name) for name in tensor_of if hasattr(dist, name)}

    def counting(name, call):
        def counted(*args, **kwargs):
            t = tensor_of[name](*args, **kwargs)
            counts["calls"] += 1
            counts["bytes"] += t.numel() * t.element_size() if torch.is_tensor(t) else 0
            return call(*args, **kwargs)
        return counted
    for name, call in originals.items():
        setattr(dist, name, counting(name, call))
    try:
        yield counts
    finally:
        for name, call in originals.items():
            setattr(dist, name, call)


def counted_allreduce_hook(process_group, bucket):
    """What DDP's reference allreduce_hook does with a bucket (divide by N, allreduce: the same
    arithmetic as without a hook), through dist.all_reduce so that counted_collectives() sees it."""
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer().div_(group.size())
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


COUNT_STEPS = 3  # the run that counts a peer's bytes: its last step counted (ZeRO's overlap updates from the third)
COUNTS = {}  # a peer's label -> its collectives' {"calls", "bytes"} of one step, counted once per job


@functools.lru_cache(maxsize=None)
def fastest_adamw():
    """AdamW's fastest implementation in this torch on the CPU: {"fused": True} where its CPU build
    steps one, else {"foreach": True} (the peers' setting; torch's default on the CPU is a loop over
    the tensors)."""
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.ones(4)
    try:
        torch.optim.AdamW([p], fused=True).step()
        return (("fused", True),)
    except (RuntimeError, TypeError, ValueError):
        return (("foreach", True),)


def adamw_name(options):
    return "AdamW, " + ", ".join(f"{k}=True" for k, _ in options)


def matched_bucket_mb(network=()):
    """DDP's bucket_cap_mb matched to sharded_data_parallel.py's exchange: it reduce-scatters one flat
    vector per layer, so DDP's buckets are capped at the largest layer's bytes (float32)."""
    sdp = importlib.import_module("sharded_data_parallel")
    model = sdp.build_model(defaults("sharded_data_parallel", 1, *network))
    return max(sum(p.numel() for p in layer.parameters()) for layer in model.layers) * 4 / 2 ** 20


def gpt_training(ctx, wrap, make_optimizer, local_state=lambda o: o.state, shards_parameters=False, network=(),
                 counting=False, warmup=1):
    """sharded_data_parallel.py's default training (its GPT from the seed, each rank's slice of
    every global batch, AdamW with its hyper-parameters) with the model wrapped by wrap(model,
    counting) and the optimizer make_optimizer(model, counting, parameters, **AdamW's settings). Its step time,
    the global losses, the bytes a rank holds (the largest over ranks) and its measured peak; with
    shards_parameters, also the peak of whole layers gathered at once. With counting: COUNT_STEPS
    steps with torch.distributed's collectives counted (the wrap adds DDP's counting hook), and the
    last step's counts returned; the timed runs count nothing, so no Python wrapper slows them."""
    sdp = importlib.import_module("sharded_data_parallel")
    a, comm, device = defaults("sharded_data_parallel", ctx.comm.Get_size(), *network), ctx.comm, ctx.device
    if device.type == "cuda":
        raise CannotRun("the ZeRO peers are measured on the CPU only")
    rank, n = comm.Get_rank(), comm.Get_size()
    meter = sdp.PeakMemory(device)  # the peak, measured as the strategy scripts measure theirs
    model = wrap(sdp.build_model(a).to(device), counting)
    optimizer = make_optimizer(model, counting, model.parameters(), lr=a.lr, betas=sdp.BETAS, eps=sdp.EPS,
                               weight_decay=sdp.WEIGHT_DECAY)
    per_rank = a.batch_size // n
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    gathered = [0]  # whole layers held at once, sampled as each layer's forward starts
    steps = COUNT_STEPS if counting else ctx.args.steps

    def sample(module, args):
        from torch.distributed.tensor import DTensor
        whole = [p for layer in model.layers for p in layer.parameters() if not isinstance(p, DTensor)]
        gathered[0] = max(gathered[0], held_bytes(whole))
    if shards_parameters:  # after fully_shard's own hooks: the layer is whole by then
        for layer in model.layers:
            layer.register_forward_pre_hook(sample)

    with counted_collectives() if counting else contextlib.nullcontext(collections.Counter()) as counts:
        def step(i):
            if i == steps - 1:
                counts.clear()  # the last step alone
            x, y = sdp.make_batch(a.seed, i, a.batch_size, a.seq_len)
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x[mine].to(device)).flatten(0, 1), y[mine].to(device).flatten())
            loss.backward()
            optimizer.step()
            return loss.item()

        meter.reset()
        seconds, losses = timed(comm, steps, step, device, warmup=min(warmup, steps - 1))
        meter.stop()
    if counting:
        return {"calls": max(comm.allgather(counts["calls"])), "bytes": max(comm.allgather(counts["bytes"]))}
    params = list(model.parameters())
    state = [v for s in local_state(optimizer).values() for v in s.values() if torch.is_tensor(v)]
    memory = {"parameters": held_bytes(params), "gradients": held_bytes(p.grad for p in params),
              "optimizer": held_bytes(state), "gathered": gathered[0]}
    every = comm.allgather({**memory, "total": sum(memory.values())})
    return {"step_time_s": seconds, "losses": [sum(ls) / n for ls in zip(*comm.allgather(losses))],
            "live_bytes_after_last_step": {k: max(m[k] for m in every) for k in every[0]},
            "peak_memory_bytes_per_rank": comm.allgather(meter.bytes), **ddp_buckets(model)}


def peer_training(label, **training):
    """A ZeRO peer's case: timed by gpt_training(**training) without counting, and its bytes and calls
    per step from one separate counting run, the first time the job runs it."""
    key = (label, tuple(map(str, training.get("network", ()))))

    def run(ctx):
        result = gpt_training(ctx, **training)
        if key not in COUNTS:
            COUNTS[key] = gpt_training(ctx, **training, counting=True)
        return {**result, "comm_bytes_per_step": COUNTS[key]["bytes"], "collectives_per_step": COUNTS[key]["calls"]}
    return run


def ddp_wrap(bucket_mb):
    """DistributedDataParallel on gloo, its buckets capped at `bucket_mb`, the gradients views into
    them (gradient_as_bucket_view: no copy in or out); DDP's own allreduce, or in the counting run
    the same arithmetic through a comm hook that counted_collectives() sees."""
    def wrap(model, counting):
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
        if counting:
            wrapped.register_comm_hook(None, counted_allreduce_hook)
        return wrapped
    return wrap


def ddp_adamw(label, network=()):
    """The unsharded baseline: DDP and a whole AdamW (fused or foreach) on every rank."""
    options = dict(fastest_adamw())
    return peer_training(label, wrap=ddp_wrap(matched_bucket_mb(network)), network=network,
                         make_optimizer=lambda model, counting, parameters, **adamw: torch.optim.AdamW(
                             parameters, **adamw, **options))


def zero_redundancy(label, overlap, network=()):
    """ZeRO stage 1 as PyTorch ships it: DDP allreduces the whole gradients, and
    ZeroRedundancyOptimizer steps AdamW (fused or foreach) on the parameters this rank owns (whole
    tensors, spread over the ranks by size), then broadcasts them from their owners, one flat bucket
    per owner (parameters_as_bucket_view). With overlap, as its documentation recommends: each
    owner's update runs in DDP's comm hook as its bucket's allreduce completes (overlap_with_ddp,
    hook_with_zero_step), and the broadcasts overlap backward; torch refuses it on gloo, and the
    case's one line says so."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    options, wrap = dict(fastest_adamw()), ddp_wrap(matched_bucket_mb(network))

    def make(model, counting, parameters, **adamw):
        zero = ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.AdamW, overlap_with_ddp=overlap,
                                       parameters_as_bucket_view=True, **adamw, **options)
        if overlap:
            from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            try:
                hook = hook_with_zero_step(counted_allreduce_hook if counting else allreduce_hook, model, zero)
            except RuntimeError as e:
                raise CannotRun(f"torch {torch.__version__} refuses overlap_with_ddp on gloo: {e}")
            model.register_comm_hook(None, hook)
        return zero

    def wrapped(model, counting):  # with overlap the ZeRO hook is the only one: it counts in the counting run
        return wrap(model, counting and not overlap)
    return peer_training(label, wrap=wrapped, make_optimizer=make, network=network,
                         local_state=lambda o: o.optim.state, warmup=3 if overlap else 1)  # its local AdamW


def fsdp2(label, reshard_after_forward, network=()):
    """FSDP2's fully_shard on each layer of the GPT and on the GPT, on a CPU mesh over gloo:
    parameters, gradients and AdamW's state sharded (ZeRO stage 3), AdamW with foreach=True (a
    loop of the same DTensor operations per step otherwise); with reshard_after_forward False the
    layers stay whole from their forward to their backward (as ZeRO stage 2 holds them)."""
    def run(ctx):
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
        except ImportError as e:
            raise CannotRun(f"this torch has no FSDP2 fully_shard: {e}")

        def wrap(model, counting):
            mesh = init_device_mesh(ctx.device.type, (ctx.comm.Get_size(),))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
            return model
        return peer_training(label, wrap=wrap, shards_parameters=True, network=network,
                             make_optimizer=lambda model, counting, parameters, **adamw: torch.optim.AdamW(
                                 parameters, foreach=True, **adamw))(ctx)
    return run


def zero_cases(ctx):
    sdp = "sharded_data_parallel"
    cases = [Case(f"{sdp}.py --zero-stage {k}", {"kind": "strategy", "strategy": sdp, "stage": k},
                  strategy(sdp, "--zero-stage", k)) for k in (1, 2, 3)]
    # stages 2 and 3 again with --no-overlap: the baseline against which their overlap is timed
    cases += [Case(f"{sdp}.py --zero-stage {k} --no-overlap",
                   {"kind": "strategy", "strategy": sdp, "stage": k, "overlap": False},
                   strategy(sdp, "--zero-stage", k, "--no-overlap")) for k in (2, 3)]
    cases += [bare_of(cases[k - 1], sdp, "--zero-stage", k) for k in (1, 2, 3)]
    cases += [ours_on_gloo(cases[k - 1], sdp, "--zero-stage", k) for k in (1, 2, 3)]
    return cases + zero_peers()


def zero_peers(network=(), suffix=""):
    """PyTorch's ZeRO of each stage and DDP + AdamW, as an expert would set them on the CPU: AdamW
    fused (or foreach), DDP's buckets matched to ours, ZeroRedundancyOptimizer also with
    overlap_with_ddp, FSDP2's AdamW foreach=True."""
    adamw, bucket = adamw_name(fastest_adamw()), matched_bucket_mb(network)
    peers = [(f"PyTorch DDP + {adamw} (gloo), unsharded, bucket_cap_mb {bucket:.2f}", {"variant": "ddp", "stage": 0},
              lambda label: ddp_adamw(label, network)),
             (f"ZeroRedundancyOptimizer({adamw}, parameters_as_bucket_view) + DDP (gloo), ZeRO-1",
              {"variant": "zero_redundancy", "stage": 1}, lambda label: zero_redundancy(label, False, network)),
             (f"ZeroRedundancyOptimizer({adamw}, overlap_with_ddp) + DDP (gloo), ZeRO-1",
              {"variant": "zero_redundancy_overlap", "stage": 1}, lambda label: zero_redundancy(label, True, network)),
             ("FSDP2 fully_shard, reshard_after_forward=False (gloo, AdamW, foreach=True), ZeRO-2",
              {"variant": "fsdp2_no_reshard", "stage": 2}, lambda label: fsdp2(label, False, network)),
             ("FSDP2 fully_shard (gloo, AdamW, foreach=True), ZeRO-3", {"variant": "fsdp2", "stage": 3},
              lambda label: fsdp2(label, True, network))]
    return [Case(label + suffix, {"kind": "peer", **tags, "gloo": True}, make(label)) for label, tags, make in peers]


# -----------------------------------------------------------------------------
# Hybrid parallelism: the 2 x 2 x 2 grid beside the one-axis grids of the same file and model
# -----------------------------------------------------------------------------
HYBRID_M = 2  # micro-batches in every grid: --dp 8 leaves 2 sequences a replica of the batch of 16


def hybrid_grid(d, t, p):
    return ("--dp", d, "--tp", t, "--pp", p, "--micro-batches", HYBRID_M)


def largest_axis(ctx, axis):
    """The grid with the most ranks on `axis` (tp or pp) that hybrid_parallel.py accepts at this
    world size, the rest data-parallel: (flags, None), or for the whole world on that axis the
    one line why not and the largest that works."""
    hp, n = importlib.import_module("hybrid_parallel"), ctx.comm.Get_size()
    whole, why = None, None
    for k in sorted((k for k in range(2, n + 1) if n % k == 0), reverse=True):
        flags = hybrid_grid(n // k, *((k, 1) if axis == "tp" else (1, k)))
        try:
            hp.parse_args([str(f) for f in flags], n)
        except hp.ConfigError as e:
            why = why or str(e).split(";")[0]
            continue
        whole = flags
        break
    return whole, why


def hybrid_cases(ctx):
    """hybrid_parallel.py on its 2 x 2 x 2 grid and on the grids of one axis at the same world size."""
    hp, n = "hybrid_parallel", ctx.comm.Get_size()
    if not (ROOT / f"{hp}.py").is_file():  # its one row says so
        return [Case(f"{hp}.py", {"kind": "strategy", "strategy": hp, "grid": "2x2x2"}, strategy(hp))]
    cases = [Case(f"{hp}.py --dp 2 --tp 2 --pp 2", {"kind": "strategy", "strategy": hp, "grid": "2x2x2"},
                  strategy(hp, *hybrid_grid(2, 2, 2))),
             Case(f"{hp}.py --dp {n}", {"kind": "strategy", "strategy": hp, "grid": "dp"},
                  strategy(hp, *hybrid_grid(n, 1, 1)))]
    for axis in ("tp", "pp"):
        flags, why = largest_axis(ctx, axis)
        if why:  # the whole world on one axis does not fit this model: one line why, then the most that does
            def cannot(ctx, why=why):
                raise CannotRun(why)
            cases.append(Case(f"{hp}.py --{axis} {n}", {"kind": "strategy", "strategy": hp, "grid": axis},
                              cannot))
        if flags:
            label = " ".join(f"{f} {v}" for f, v in zip(flags[0:6:2], flags[1:6:2]) if v > 1)
            cases.append(Case(f"{hp}.py {label}", {"kind": "strategy", "strategy": hp,
                                                   "grid": axis if not why else f"most {axis}"},
                              strategy(hp, *flags)))
    return cases


# -----------------------------------------------------------------------------
# The exactness matrix: hybrid_parallel.py with --check on each axis alone, the pairs, the triples, all five
# -----------------------------------------------------------------------------
# One small network for every grid: 2 heads and 3 blocks divide over --tp 2 and --pp 2; 8 positions over
# the 2C = 4 chunks of --cp 2 zigzag, times --tp 2 with --sequence-parallel; 8 sequences over --dp 4 x M = 2.
MATRIX_NETWORK = ("--layers", 3, "--hidden", 16, "--heads", 2, "--seq-len", 8, "--batch-size", 8,
                  "--micro-batches", 2)
EXPERTS = ("--experts", 4)
MATRIX = [  # the world size and the grid's flags (an axis not named is 1; --dp takes what the others leave)
    (1, ()),
    (2, ("--dp", 2)), (2, ("--tp", 2)), (2, ("--pp", 2)), (2, ("--cp", 2)), (2, ("--cp", 2, "--layout", "contiguous")),
    (2, ("--dp", 2, "--zero-stage", 1)), (2, ("--tp", 2, "--sequence-parallel")),
    (2, ("--ep", 2, *EXPERTS)), (2, ("--ep", 2, *EXPERTS, "--capacity-factor", 1)), (2, ("--cp", 2, "--ep", 2, *EXPERTS)),
    (4, ("--dp", 2, "--tp", 2)), (4, ("--dp", 2, "--pp", 2)), (4, ("--dp", 2, "--cp", 2)),
    (4, ("--tp", 2, "--pp", 2)), (4, ("--tp", 2, "--cp", 2)), (4, ("--pp", 2, "--cp", 2)),
    (4, ("--dp", 2, "--cp", 2, "--layout", "contiguous", "--zero-stage", 1)),
    (4, ("--tp", 2, "--cp", 2, "--sequence-parallel")),
    (4, ("--tp", 2, "--ep", 2, *EXPERTS)), (4, ("--pp", 2, "--ep", 2, *EXPERTS)),
    (4, ("--dp", 2, "--cp", 2, "--ep", 4, *EXPERTS, "--capacity-factor", 1)),
    (8, ("--dp", 2, "--tp", 2, "--pp", 2)), (8, ("--dp", 2, "--cp", 2, "--tp", 2)),
    (8, ("--pp", 2, "--cp", 2, "--tp", 2, "--sequence-parallel")), (8, ("--pp", 2, "--dp", 2, "--cp", 2, "--zero-stage", 1)),
    (8, ("--pp", 2, "--dp", 4, "--ep", 2, *EXPERTS, "--zero-stage", 1)),
    (16, ("--dp", 2, "--tp", 2, "--pp", 2, "--cp", 2, "--ep", 2, *EXPERTS, "--sequence-parallel", "--zero-stage", 1)),
]


# The recipe users train with on every grid: AdamW, the global norm clipped at 1 (these three steps' norms are
# 1.3 to 2.5 in one process: every step clipped), a warm-up into a cosine, and documents of uneven length
# (the loss over the valid targets of the whole step). lr 1e-3: at 1e-2 AdamW's first step turns a float32
# reordering of a gradient near its eps (2e-8) into 3e-5, past the check's 2e-5, in one process too.
MATRIX_RECIPE = ("--optimizer", "adamw", "--lr", 0.001, "--clip-grad", 1, "--lr-schedule", "cosine",
                 "--warmup-steps", 1, "--ragged")


def matrix_cases(ctx):
    """Every grid of MATRIX that fits the job, with the recipe, in fp32 and then in bf16, each on the
    job's first N ranks (the others sleep), one after the other: the matrix is of differences, not of
    ratios."""
    hp = "hybrid_parallel"
    return [Case(f"{hp}.py " + (" ".join(map(str, flags)) or "(one process)") + f" [{precision}]",
                 {"kind": "strategy", "strategy": hp, "n": n, "flags": [str(f) for f in flags], "precision": precision,
                  "recipe": [str(f) for f in MATRIX_RECIPE]},
                 norms_against_the_reference(n, [*MATRIX_NETWORK, *MATRIX_RECIPE, "--precision", precision, *flags]))
            for precision in ("fp32", "bf16") for n, flags in MATRIX
            if n <= ctx.comm.Get_size()]


def norms_against_the_reference(n, flags):
    """hybrid_parallel.py on the first n ranks, then on rank 0 its one-process reference trained once
    more (the file's reference_training) for the gradient norms' largest |difference|, step by step:
    the script's check folds them into one number with the rest. With experts this reference routes
    on its own, where the check's follows the ranks' choices (which this process never sees): a
    near-tie that flips can make this column the larger."""
    run = on_first(n, strategy("hybrid_parallel", *flags))

    def case(ctx):
        result = run(ctx)
        if ctx.comm.Get_rank() == 0 and result and result.get("grad_norms"):
            hp = importlib.import_module("hybrid_parallel")
            args = hp.parse_args([str(f) for f in (*flags, "--steps", ctx.args.steps)], n)
            norms = hp.reference_training(args, torch.device("cpu"))[1]
            result = {**result, "norm_max_abs_diff": max(abs(a - b) for a, b in zip(result["grad_norms"], norms))}
        return result
    return case


# -----------------------------------------------------------------------------
# Context parallelism: ring, all-gather and all-to-all; zigzag against contiguous; torch's context_parallel
# -----------------------------------------------------------------------------
CP_NETWORK = ("--seq-len", 240)  # twice the script's default sequence, the same in every case and N


def torch_context_parallel(ctx):
    """context_parallel.py's network and batch under torch.distributed.tensor.experimental's
    context_parallel on gloo: the whole model on every rank, its attention torch's causal
    scaled_dot_product_attention, the inputs, targets and positions cut along the sequence by
    torch (its load balancer), the parameters' gradients and the loss summed over the ranks, as
    context_parallel.py sums them. A first step is tried on every rank before the timing: where
    torch cannot run it, the case's one line is what it raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    cpm = importlib.import_module("context_parallel")
    comm, device, n = ctx.comm, ctx.device, ctx.comm.Get_size()
    if device.type == "cuda":
        raise CannotRun("the context-parallel peer is measured on the CPU only (gloo)")
    a = defaults("context_parallel", n, *CP_NETWORK)
    model = cpm.build_model(a, device)
    model.attention = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mesh = init_device_mesh(device.type, (n,))
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    tokens = a.batch_size * a.seq_len

    def step(i):
        x, y = cpm.make_batch(a.seed, i, a.batch_size, a.seq_len)
        positions = torch.arange(a.seq_len)
        optimizer.zero_grad(set_to_none=False)
        with context_parallel(mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={x, y, positions}):
            loss = F.cross_entropy(model(x, positions).flatten(0, 1), y.flatten(), reduction="sum") / tokens
            loss.backward()
        for p in model.parameters():  # each rank saw its share of the positions: sum, as the script does
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        optimizer.step()
        return total.item()

    error = None
    try:  # a first forward and backward, before any collective: a rank that cannot run it tells the others
        x, y = cpm.make_batch(a.seed, 0, a.batch_size, a.seq_len)
        positions = torch.arange(a.seq_len)
        with context_parallel(mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={x, y, positions}):
            F.cross_entropy(model(x, positions).flatten(0, 1), y.flatten()).backward()
    except Exception as e:  # noqa: BLE001 (told to every rank below)
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise CannotRun(f"does not run on CPU processes: torch {torch.__version__} replaces only the CUDA kernels "
                        f"of scaled_dot_product_attention (flash, efficient, cuDNN) with its ring, and the CPU's "
                        f"raised {errors[0]}" if "_for_cpu" in errors[0] else errors[0])
    seconds, losses = timed(comm, ctx.args.steps, step, device)
    return {"step_time_s": seconds, "losses": losses}


def context_cases(ctx):
    cp = "context_parallel"
    return [Case(f"{cp}.py --cp-comm ring --layout zigzag", {"kind": "strategy", "strategy": cp,
                                                              "cp_comm": "ring", "layout": "zigzag"},
                 strategy(cp, *CP_NETWORK)),
            Case(f"{cp}.py --cp-comm allgather --layout zigzag",
                 {"kind": "strategy", "strategy": cp, "cp_comm": "allgather", "layout": "zigzag"},
                 strategy(cp, *CP_NETWORK, "--cp-comm", "allgather")),
            Case(f"{cp}.py --cp-comm alltoall --layout zigzag",  # the script refuses N that do not divide the heads
                 {"kind": "strategy", "strategy": cp, "cp_comm": "alltoall", "layout": "zigzag"},
                 strategy(cp, *CP_NETWORK, "--cp-comm", "alltoall")),
            Case(f"{cp}.py --cp-comm ring --layout contiguous",
                 {"kind": "strategy", "strategy": cp, "cp_comm": "ring", "layout": "contiguous"},
                 strategy(cp, *CP_NETWORK, "--layout", "contiguous")),
            Case(f"{cp}.py --cp-comm ring --layout zigzag --no-overlap",
                 {"kind": "strategy", "strategy": cp, "cp_comm": "ring", "layout": "zigzag", "overlap": False},
                 strategy(cp, *CP_NETWORK, "--no-overlap")),
            Case("torch.distributed.tensor.experimental.context_parallel (gloo)", {"kind": "peer", "gloo": True},
                 torch_context_parallel)]


# -----------------------------------------------------------------------------
# Expert parallelism: the experts spread over the ranks against every rank holding them all
# -----------------------------------------------------------------------------
EP_CAPACITY = 1.0  # a capacity factor that drops the pairs beyond an even share


def expert_cases(ctx):
    ep, n = "expert_parallel", ctx.comm.Get_size()
    cases = [Case(f"{ep}.py --ep {n}", {"kind": "strategy", "strategy": ep, "ep": n, "capacity": None},
                  strategy(ep, "--ep", n)),
             Case(f"{ep}.py --ep 1", {"kind": "strategy", "strategy": ep, "ep": 1, "capacity": None},
                  strategy(ep, "--ep", 1))]
    return cases + [Case(f"{ep}.py --ep {n} --capacity-factor {EP_CAPACITY:g}",
                         {"kind": "strategy", "strategy": ep, "ep": n, "capacity": EP_CAPACITY},
                         strategy(ep, "--ep", n, "--capacity-factor", EP_CAPACITY))] if n > 1 else cases


# -----------------------------------------------------------------------------
# A larger model: one row per strategy where compute, not the framework's overhead, decides
# -----------------------------------------------------------------------------
# The GPT of the scripts at 4 blocks x 256 hidden (3.2 million parameters, 16 times the default's
# compute per token): the largest whose rounds fit the bench's time on 2 shared cores (the
# 25-million-parameter GPT of sharded_data_parallel.py's memory runs takes about 9 s a step there).
LARGE = ("--layers", 4, "--hidden", 256, "--heads", 4, "--seq-len", 32)
LARGE_M = 4  # micro-batches of the pipeline rows


def large_cases(ctx):
    """Each strategy that has a peer, on the larger GPT, beside its peer configured as in its own
    group, and the bare exchanges of its step. data_parallel.py trains only its LeNet, so data
    parallelism is here as ZeRO's unsharded baseline (DDP + AdamW) against stage 1."""
    tp, pp, sdp = "tensor_parallel", "pipeline_parallel", "sharded_data_parallel"
    pairs = [
        ("tp", Case(f"{tp}.py", {"kind": "strategy", "strategy": tp, "pair": "tp"},
                    strategy(tp, *LARGE, "--sample-chars", 0)),
         Case("torch.distributed.tensor.parallel (DTensor, eager)", {"kind": "peer", "pair": "tp", "gloo": True},
              torch_tensor_parallel(False, LARGE)), (tp, *LARGE, "--sample-chars", 0)),
        ("pp", Case(f"{pp}.py --schedule 1f1b --micro-batches {LARGE_M}",
                    {"kind": "strategy", "strategy": pp, "pair": "pp"},
                    strategy(pp, *LARGE, "--schedule", "1f1b", "--micro-batches", LARGE_M)),
         Case(f"torch.distributed.pipelining Schedule1F1B, M = {LARGE_M}", {"kind": "peer", "pair": "pp", "gloo": True},
              torch_pipeline("Schedule1F1B", LARGE_M, LARGE)),
         (pp, *LARGE, "--schedule", "1f1b", "--micro-batches", LARGE_M)),
        ("zero1", Case(f"{sdp}.py --zero-stage 1", {"kind": "strategy", "strategy": sdp, "pair": "zero1"},
                       strategy(sdp, *LARGE, "--zero-stage", 1)), None, (sdp, *LARGE, "--zero-stage", 1)),
        ("zero3", Case(f"{sdp}.py --zero-stage 3", {"kind": "strategy", "strategy": sdp, "pair": "zero3"},
                       strategy(sdp, *LARGE, "--zero-stage", 3)), None, (sdp, *LARGE, "--zero-stage", 3)),
    ]
    cases = [c for _, ours, peer, _ in pairs for c in (ours, peer) if c is not None]
    pair_of = {"ddp": "ddp", "zero_redundancy": "zero1", "zero_redundancy_overlap": "zero1", "fsdp2": "zero3"}
    cases += [Case(c.label, {**c.tags, "pair": pair_of[c.tags["variant"]]}, c.run) for c in zero_peers(LARGE)
              if c.tags["variant"] in pair_of]
    return (cases + [bare_of(ours, *flags) for _, ours, _, flags in pairs]
            + [ours_on_gloo(ours, *flags) for _, ours, _, flags in pairs])


# -----------------------------------------------------------------------------
# Precision and recomputation: each script in fp32 and bf16, and with --recompute selective and full
# -----------------------------------------------------------------------------
SCRIPTS = ("data_parallel", "tensor_parallel", "pipeline_parallel", "model_parallel", "sharded_data_parallel",
           "context_parallel", "expert_parallel", "hybrid_parallel")


def precision_cases(ctx):
    """Every script at its defaults in fp32 and in bf16 (autocast on float32 master weights), and
    each of the seven with transformer blocks with --recompute selective and full (fp32), on the same
    ranks, taking turns: the step-time ratios are paired by round."""
    cases = []
    for module in SCRIPTS:
        runs = [("fp32", "none"), ("bf16", "none")]
        runs += [] if module == "data_parallel" else [("fp32", "selective"), ("fp32", "full")]
        cases += [Case(f"{module}.py --precision {p}" + (f" --recompute {r}" if r != "none" else ""),
                       {"kind": "strategy", "strategy": module, "precision": p, "recompute": r},
                       strategy(module, "--precision", p, "--recompute", r)) for p, r in runs]
    return cases


# -----------------------------------------------------------------------------
# Scaling: each strategy at N = 1, 2, 4 in one job, so that the sizes take turns too
# -----------------------------------------------------------------------------
def wait_quietly(comm):
    """A barrier that sleeps between polls: the ranks left out leave the cores to the others."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def on_first(n, run):
    """A case run on the first n ranks of the job, as `mpirun -np n` would (the strategies set
    their threads from the size of the communicator they are given); the others sleep."""
    def case(ctx):
        rank = ctx.comm.Get_rank()
        sub = ctx.comm.Split(0 if rank < n else MPI.UNDEFINED, rank)
        try:
            if sub != MPI.COMM_NULL:
                return run(argparse.Namespace(**{**vars(ctx), "comm": sub}))
            return {}
        finally:
            if sub != MPI.COMM_NULL:
                sub.Free()
            wait_quietly(ctx.comm)
    return case


def one_thread(run):
    """A case whose strategy runs with one torch thread, whatever it asks for: one rank on one
    core, the baseline against which N ranks on N cores are compared."""
    def case(ctx):
        set_num_threads = torch.set_num_threads
        torch.set_num_threads = lambda n: set_num_threads(1)
        try:
            return run(ctx)
        finally:
            torch.set_num_threads = set_num_threads
            set_num_threads(max(1, (os.cpu_count() or 1) // node_layout(ctx.comm)[1]))
    return case


def scaling_cases(ctx):
    """The scaling run of every strategy (tagged in its group) at every size up to the job's,
    and at N = 1 also on one thread, where the scripts' rule would give it every core."""
    runs = [c for group in ("dp", "pp", "tp") for c in GROUPS[group](ctx) if c.tags.get("scaling")]
    cases = [Case(c.label, {**c.tags, "n": 1, "threads": 1}, on_first(1, one_thread(c.run))) for c in runs
             if (os.cpu_count() or 1) > 1 and ctx.device.type == "cpu"]
    return cases + [Case(c.label, {**c.tags, "n": n, "threads": max(1, (os.cpu_count() or 1) // n)},
                         on_first(n, c.run))
                    for n in (1, 2, 4) if n <= ctx.comm.Get_size() for c in runs]


GROUPS = {"dp": data_parallel_cases, "pp": pipeline_cases, "tp": tensor_cases, "zero": zero_cases,
          "hybrid": hybrid_cases, "cp": context_cases, "ep": expert_cases, "scaling": scaling_cases,
          "transport": transport_cases, "large": large_cases, "precision": precision_cases, "matrix": matrix_cases}
CONFIG_OF = {"dp": "data_parallel", "pp": "pipeline_parallel", "tp": "tensor_parallel",
             "zero": "sharded_data_parallel", "hybrid": "hybrid_parallel", "cp": "context_parallel",
             "ep": "expert_parallel"}


# -----------------------------------------------------------------------------
# Rounds, and what rank 0 prints
# -----------------------------------------------------------------------------
def give_back_freed_memory():
    """What the cases before have freed goes back to the system before the next starts: a case's peak
    (the resident set's, less the process before its model) then counts its own memory, not a heap that
    an earlier case left behind for it to reuse unseen."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_case(ctx, fn):
    """fn(ctx) on every rank; a failure on every rank becomes the case's error line."""
    error = None
    give_back_freed_memory()
    try:
        result = fn(ctx)
    except CannotRun as e:
        error, result = str(e), None
    except Exception as e:  # one line for the table; the traceback for whoever reads stderr
        traceback.print_exc(file=sys.stderr)
        error, result = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", None
    errors = [e for e in ctx.comm.allgather(error) if e]
    return {"error": errors[0]} if errors else result


def combine(rounds):
    """One result from the rounds: numbers are medians over rounds, the rest from the first."""
    first = dict(rounds[0])
    for key, value in first.items():
        if isinstance(value, float):
            first[key] = statistics.median(r[key] for r in rounds)
    for key in ("step_time_s", "comm_s", "bare_mpi_s", "bare_gloo_s"):  # for ratios paired round by round
        if key in first:
            first[f"{key}_rounds"] = [r[key] for r in rounds]
    return first


def config(group, world_size):
    """The network and batch of a group, as its strategy file's defaults set them."""
    if group == "large":
        return dict(zip(("layers", "hidden", "heads", "seq_len"), LARGE[1::2]))
    if group == "matrix":
        return {k.lstrip("-").replace("-", "_"): v for k, v in zip(MATRIX_NETWORK[0::2], MATRIX_NETWORK[1::2])}
    try:
        if group == "hybrid":  # its default grid (all data-parallel) does not split the batch at 8 ranks
            a = importlib.import_module(CONFIG_OF[group]).parse_args([str(f) for f in hybrid_grid(2, 2, 2)],
                                                                     world_size)
        else:
            a = defaults(CONFIG_OF[group], world_size, *{"pp": PP_NETWORK, "cp": CP_NETWORK}.get(group, ()))
    except Exception:  # noqa: BLE001 (a group with no network of its own, a grid this size cannot hold)
        return None
    return {k: getattr(a, k) for k in ("batch_size", "layers", "hidden", "heads", "seq_len", "lr", "seed",
                                       "experts", "top_k") if hasattr(a, k)}


def wanted(tags, args):
    if args.without_gloo and tags.get("gloo"):
        return False
    if tags["kind"] == "on_gloo" and args.device == "cuda":  # the shim carries CPU tensors only
        return False
    is_strategy = tags["kind"] == "strategy"
    return {"all": True, "strategies": is_strategy, "peers": not is_strategy}[args.cases]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="+", choices=sorted(GROUPS), metavar="GROUP",
                   help=f"one or more of {', '.join(sorted(GROUPS))}")
    p.add_argument("--rounds", type=int, default=3, help="at most this many runs of every case, taking turns")
    p.add_argument("--steps", type=int, default=20, help="steps per run")
    p.add_argument("--collective-reps", type=int, default=60, help="repetitions of a bare collective")
    p.add_argument("--bare-seconds", type=float, default=BARE_SECONDS,
                   help="a bare replay's time on both transports together (at least 3 replays each)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--check", action="store_true", help="run the strategies with --check")
    p.add_argument("--cases", choices=("all", "strategies", "peers"), default="all",
                   help="strategies: the scripts alone; peers: all but the scripts")
    p.add_argument("--seconds", type=float, default=float("inf"),
                   help="start no new round after this many seconds (at least one round runs)")
    p.add_argument("--without-gloo", action="store_true", help="leave out the cases that use gloo")
    p.add_argument("--micro-batches", default=None,
                   help="values of M for the pipeline, e.g. 2,4,8 (default: N, 2N, 4N)")
    p.add_argument("--small-bucket-mb", type=float, default=0.05, help="buckets small enough to overlap")
    args = p.parse_args(argv)
    args.micro_batches = [int(m) for m in args.micro_batches.split(",")] if args.micro_batches else None
    return args


def main(argv=None):
    comm = MPI.COMM_WORLD
    # as the strategies' start_mpi(): freed memory goes back to the system, so that the peak
    # resident set of one case does not hide inside the heap another case left behind
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    args = parse_args(argv)
    local_rank, ranks_here = node_layout(comm)
    if args.device == "cpu":  # as the strategies do: oversubscribed ranks must not thrash
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    ctx = argparse.Namespace(comm=comm, args=args, device=device_of(args.device, local_rank))
    if args.device == "cuda":
        torch.cuda.set_device(ctx.device)
    init_gloo(comm)
    cases = [(group, c) for group in args.groups for c in GROUPS[group](ctx) if wanted(c.tags, args)]
    rounds, failed, start = [[] for _ in cases], {}, time.perf_counter()
    for r in range(args.rounds):
        # Rank 0 decides for all whether one more round (as long as the last) fits the budget.
        elapsed = time.perf_counter() - start
        if r and not comm.bcast(elapsed * (r + 1) / r <= args.seconds, root=0):
            break
        for k in range(len(cases)):  # each round starts one case later: no case always goes first
            i = (k + r) % len(cases)
            if i not in failed:
                result = run_case(ctx, cases[i][1].run)
                if "error" in result:
                    failed[i] = result
                else:
                    rounds[i].append(result)
    dist.destroy_process_group()
    if comm.Get_rank() == 0:
        print(json.dumps({
            "world_size": comm.Get_size(), "ranks_per_node": ranks_here, "cores": os.cpu_count(),
            "torch_threads": max(1, (os.cpu_count() or 1) // ranks_here), "device": args.device,
            "rounds": max(len(rs) for rs in rounds) if cases else 0,
            "steps": args.steps, "check": args.check,
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
            "mpi_thread_multiple": MPI.Query_thread() == MPI.THREAD_MULTIPLE,
            "groups": {group: {"config": config(group, comm.Get_size()), "cases": [
                {"label": c.label, "tags": c.tags, "result": failed.get(i) or combine(rounds[i])}
                for i, (g, c) in enumerate(cases) if g == group]} for group in args.groups}}),
              flush=True)


def abort_on_exception(kind, value, tb):
    """An exception outside a case must end the whole job, not leave the others waiting."""
    text = "".join(traceback.format_exception(kind, value, tb))
    print(f"rank {MPI.COMM_WORLD.Get_rank()}: {text}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    sys.excepthook = abort_on_exception
    main()
