"""bench/worker.py's GlooComm, which carries a strategy's exchanges on gloo for the bench's rows "ours on
gloo": each exchange through it against MPI's, bit for bit, on the bench's sizes; a strategy's --check on
it; and bench/report.py's verdict rule."""
import contextlib
import io
import json
import sys
import time

import pytest
import torch
from mpi4py import MPI

from bench import report
from bench import worker
from harness import agree, sub_comm

GRADIENTS = worker.gradient_buffer().numel()  # data_parallel.py's LeNet: 61,990 floats, 247,960 bytes
SMALL_BUCKET = int(0.05 * 2 ** 20) // 4  # the floats of one --bucket-mb 0.05 bucket
SIZES = (GRADIENTS, SMALL_BUCKET, worker.TRANSPORT_BYTES // 4)  # and the transport table's 1 MiB vector


def shim(comm, tmp_path):
    """A GlooComm over comm, its gloo group met through a FileStore in rank 0's tmp_path."""
    import torch.distributed as dist
    path = comm.bcast(str(tmp_path / "store") if comm.Get_rank() == 0 else None, root=0)
    return worker.GlooComm(comm, dist.FileStore(path, comm.Get_size()))


def counts(sender, receiver):
    """Alltoallv's uneven counts: what `sender` sends `receiver`, 0 among them."""
    return (sender + 2 * receiver) % 5


def exchanges(rank, size, numel, exact):
    """Every exchange the compared scripts hand their communicator, as (name, run(comm) -> the tensor it
    leaves on this rank). With exact, the summed vectors hold small whole numbers, so that a sum in any
    order is the same float; without, normal noise."""
    g = torch.Generator().manual_seed(1000 * size + rank)
    noise = torch.randn(numel - numel % size, generator=g)
    summed = torch.randint(-1024, 1024, noise.shape, generator=g).float() if exact else noise
    part = noise.numel() // size
    mine = noise[:part].clone()

    def allreduce(comm):
        t = summed.clone()
        comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)
        return t

    def allreduce_out_of_place(comm):
        t = torch.empty_like(summed)
        comm.Allreduce(summed, t, op=MPI.SUM)
        return t

    def iallreduce_max(comm):  # tensor_parallel.py's vocabulary-parallel loss takes a MAX
        t = noise.clone()
        request = comm.Iallreduce(MPI.IN_PLACE, t, op=MPI.MAX)
        while not request.Test():
            pass
        request.Wait()
        return t

    def iallreduce(comm):
        t = summed.clone()
        comm.Iallreduce(MPI.IN_PLACE, t, op=MPI.SUM).Wait()
        return t

    def reduce_scatter(comm):
        t = torch.empty(part)
        comm.Reduce_scatter_block(summed, t, op=MPI.SUM)
        return t

    def ireduce_scatter(comm):
        t = torch.empty(part)
        comm.Ireduce_scatter_block(summed, t, op=MPI.SUM).Wait()
        return t

    def allgather(comm):
        t = torch.empty(part * size)
        comm.Allgather(mine, t)
        return t

    def allgather_in_place(comm):  # sharded_data_parallel.py's: this rank's part already in its slot
        t = torch.zeros(part * size)
        t[rank * part:(rank + 1) * part] = mine
        comm.Allgather(MPI.IN_PLACE, t)
        return t

    def iallgather_in_place(comm):
        t = torch.zeros(part * size)
        t[rank * part:(rank + 1) * part] = mine
        comm.Iallgather(MPI.IN_PLACE, t).Wait()
        return t

    def bcast(comm):
        t = noise.clone()
        comm.Bcast(t, root=size - 1)
        return t

    def alltoall(comm):
        t = torch.empty_like(noise)
        comm.Alltoall(noise, t)
        return t

    def alltoall_counts(comm):  # expert_parallel.py's counts: int64
        sent = torch.arange(size, dtype=torch.int64) * 7 + rank
        t = torch.empty_like(sent)
        comm.Alltoall(sent, t)
        return t

    def alltoallv(comm):
        sent = [counts(rank, j) * (numel // 64) for j in range(size)]
        taken = [counts(j, rank) * (numel // 64) for j in range(size)]
        t = torch.empty(sum(taken))
        comm.Alltoallv([noise[:sum(sent)].clone(), sent], [t, taken])
        return t

    def ring(comm):  # pipeline_parallel.py's messages: Isend and Irecv, tagged, all waited for
        t = torch.empty_like(noise)
        requests = [comm.Irecv(t, source=(rank - 1) % size, tag=11), comm.Isend(noise, dest=(rank + 1) % size, tag=11)]
        for r in requests:
            r.Wait()
        return t

    def send_recv(comm):  # the blocking pair, even ranks first
        t = torch.empty_like(noise)
        if rank % 2 == 0:
            comm.Send(noise, dest=rank ^ 1, tag=3)
            comm.Recv(t, source=rank ^ 1, tag=3)
        else:
            comm.Recv(t, source=rank ^ 1, tag=3)
            comm.Send(noise, dest=rank ^ 1, tag=3)
        return t

    def sendrecv(comm):
        t = torch.empty_like(noise)
        comm.Sendrecv(noise, dest=(rank + 1) % size, sendtag=4, recvbuf=t, source=(rank - 1) % size, recvtag=4)
        return t

    return [(f.__name__, f) for f in (allreduce, allreduce_out_of_place, iallreduce_max, iallreduce, reduce_scatter,
                                      ireduce_scatter, allgather, allgather_in_place, iallgather_in_place, bcast,
                                      alltoall, alltoall_counts, alltoallv, ring, send_recv, sendrecv)]


def differing(comm, gloo, exact):
    """The names of the exchanges whose result through gloo differs from MPI's in any bit, on any rank,
    at any of the bench's sizes."""
    wrong = set()
    for numel in SIZES:
        for name, run in exchanges(comm.Get_rank(), comm.Get_size(), numel, exact):
            by_mpi, by_gloo = run(comm), run(gloo)
            if by_mpi.shape != by_gloo.shape or not torch.equal(by_mpi.view(torch.uint8), by_gloo.view(torch.uint8)):
                wrong.add(name)
    return sorted(set().union(*comm.allgather(wrong)))


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 4])
def test_each_exchange_through_gloo_equals_mpis_bit_for_bit(size, tmp_path):
    """At N = 2 on normal noise (a sum of two floats is the same in either order); at N = 4 with the
    summed vectors of whole numbers, where every order of a sum gives the same float (MPICH sums four
    ranks by recursive halving, gloo round a ring: on noise they differ in the last bit, checked below)."""
    with sub_comm(size) as comm:
        wrong = []
        if comm is not None:
            wrong = differing(comm, shim(comm, tmp_path), exact=size > 2)
        assert agree(not wrong), wrong


@pytest.mark.mpi
def test_at_four_ranks_a_sum_of_noise_differs_from_mpis_only_by_the_order_of_its_additions(tmp_path):
    """The bound of a reordered float32 sum of 4 terms: each order is within 3 (eps / 2) sum |x_i| of the
    exact sum (3 additions, each rounding once), so the two within 3 eps sum |x_i| of each other, per
    element. Measured on the LeNet's 61,990 gradients: at most 9.5e-7 apart."""
    with sub_comm(4) as comm:
        ok = True
        if comm is not None:
            gloo = shim(comm, tmp_path)
            x = torch.randn(GRADIENTS, generator=torch.Generator().manual_seed(comm.Get_rank()))
            by_mpi, by_gloo, magnitude = x.clone(), x.clone(), x.abs()
            comm.Allreduce(MPI.IN_PLACE, by_mpi, op=MPI.SUM)
            gloo.Allreduce(MPI.IN_PLACE, by_gloo, op=MPI.SUM)
            comm.Allreduce(MPI.IN_PLACE, magnitude, op=MPI.SUM)
            ok = bool(((by_mpi - by_gloo).abs() <= 3 * torch.finfo(torch.float32).eps * magnitude).all())
            # and every rank holds the same sum: replicas stay identical on gloo as on MPI
            ok = ok and all(torch.equal(by_gloo, other) for other in comm.allgather(by_gloo))
        assert agree(ok)


@pytest.mark.mpi
def test_a_chunk_misplaced_by_the_shim_is_caught(tmp_path, monkeypatch):
    """The negative control of the comparison: a reduce-scatter that hands each rank the next rank's
    sum, and an all-gather that rotates its chunks, are found, and nothing else is."""
    reduce_scatter, allgather = worker.GlooComm.Ireduce_scatter_block, worker.GlooComm.Iallgather

    def shifted(self, sendbuf, recvbuf, op=MPI.SUM):
        return reduce_scatter(self, torch.roll(sendbuf, -sendbuf.numel() // self.Get_size()), recvbuf, op)

    def rotated(self, sendbuf, recvbuf):
        request = allgather(self, sendbuf, recvbuf)
        request.Wait()
        recvbuf.copy_(torch.roll(recvbuf, recvbuf.numel() // self.Get_size()))
        return request
    monkeypatch.setattr(worker.GlooComm, "Ireduce_scatter_block", shifted)
    monkeypatch.setattr(worker.GlooComm, "Iallgather", rotated)
    planted = ["allgather", "allgather_in_place", "iallgather_in_place", "ireduce_scatter", "reduce_scatter"]
    with sub_comm(2) as comm:
        wrong = planted
        if comm is not None:
            wrong = differing(comm, shim(comm, tmp_path), exact=False)
        assert agree(wrong == planted), wrong


POLL_DEADLINE_S = 20  # a finished exchange shows within milliseconds; past this, Test is taken never to say so


def unfinished_when_polled(comm):
    """The names of the non-blocking exchanges that Test alone never reported done on some rank, as the
    scripts poll when their ranks outnumber the cores (each then waited for, so that the ranks stay in step)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    vector, part = torch.ones(size * 64), torch.empty(64)
    posted = {"iallreduce": lambda: comm.Iallreduce(MPI.IN_PLACE, vector.clone(), op=MPI.SUM),
              "ibcast": lambda: comm.Ibcast(vector.clone(), root=0),
              "iallgather": lambda: comm.Iallgather(MPI.IN_PLACE, vector.clone()),
              "ireduce_scatter": lambda: comm.Ireduce_scatter_block(vector.clone(), part, op=MPI.SUM),
              "isend_irecv": lambda: [comm.Irecv(part, source=(rank - 1) % size, tag=5),
                                      comm.Isend(vector[:64].clone(), dest=(rank + 1) % size, tag=5)]}
    unfinished = set()
    for name, post in posted.items():
        requests, start = post(), time.perf_counter()
        requests = requests if isinstance(requests, list) else [requests]
        while not all([r.Test() for r in requests]):
            if time.perf_counter() - start > POLL_DEADLINE_S:
                unfinished.add(name)
                break
            time.sleep(1e-4)
        for r in requests:
            r.Wait()
    return sorted(set().union(*comm.allgather(unfinished)))


@pytest.mark.mpi
@pytest.mark.parametrize("size", [2, 4])
def test_every_exchange_through_gloo_reports_itself_done_to_test(size, tmp_path):
    """A rank that polls (Test, then sleep) must see its exchange end: gloo's reduce-scatter, send and
    receive never say so themselves, and polling them hung the bench's jobs at N = 4 on 2 cores. The
    shim waits for those on a thread once the rank polls them (a Test again within POLLING_S);
    without it (below) the same polls never end."""
    with sub_comm(size) as comm:
        unfinished = []
        if comm is not None:
            unfinished = unfinished_when_polled(shim(comm, tmp_path))
        assert agree(not unfinished), unfinished


@pytest.mark.mpi
def test_polling_gloos_own_completion_is_caught(tmp_path, monkeypatch):
    """The negative control: the shim's former Test (gloo's is_completed() for every exchange)."""
    made = worker.GlooRequest.__new__

    def polled_always(cls, work, tensors=(), then=None, polled=True):
        return made(cls, work, tensors, then)
    monkeypatch.setattr(worker.GlooRequest, "__new__", polled_always)
    monkeypatch.setattr(sys.modules[__name__], "POLL_DEADLINE_S", 1)  # what never ends, given a second
    with sub_comm(2) as comm:
        unfinished = ["ireduce_scatter", "isend_irecv"]
        if comm is not None:
            unfinished = unfinished_when_polled(shim(comm, tmp_path))
        assert agree(unfinished == ["ireduce_scatter", "isend_irecv"]), unfinished


def exchanged(comm, wait):
    """A send to the next rank and a receive from the one before, waited for by wait(requests): the
    threads the shim started meanwhile, and whether the message arrived."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sent, received = torch.arange(64.0) + rank, torch.empty(64)
    started, start = [], worker.threading.Thread.start

    def counted(thread):
        started.append(thread)
        return start(thread)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker.threading.Thread, "start", counted)
        wait([comm.Irecv(received, source=(rank - 1) % size, tag=6),
              comm.Isend(sent, dest=(rank + 1) % size, tag=6)])
    return len(started), torch.equal(received, torch.arange(64.0) + (rank - 1) % size)


def poked_and_waited(comm, pokes):
    """exchanged(), each request Tested `pokes` times 2 ms apart (as the pipeline Tests its sends once
    an action), then waited for."""
    def wait(requests):
        for _ in range(pokes):
            [r.Test() for r in requests]
            time.sleep(2 * worker.POLLING_S)
        for r in requests:
            r.Wait()
    return exchanged(comm, wait)


@pytest.mark.mpi
@pytest.mark.parametrize("plant", [False, True])
def test_a_scripts_wait_that_polls_a_message_on_gloo_waits_in_gloo_without_a_thread(plant, tmp_path, monkeypatch):
    """Where ranks outnumber cores, the scripts' CountedRequest.Wait polls Test with naps (MPICH's Wait
    spins): on gloo, a Test from it waits in gloo's wait() and starts no thread. The negative control:
    the same polls from a loop of another name are handed to a waiting thread."""
    import pipeline_parallel as script
    monkeypatch.setattr(script, "SLEEP_WHILE_WAITING", True)
    monkeypatch.setattr(worker, "WAITERS", worker.Waiters())

    class Timeline:
        def span(self, cat, name):
            return contextlib.nullcontext()

    def scripts_wait(requests):
        for r in requests:
            script.CountedRequest(r, Timeline(), "idle", "Irecv").Wait()

    def polled(requests):
        for r in requests:
            while not r.Test():
                time.sleep(script.POLL_S)
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            threads, arrived = exchanged(shim(comm, tmp_path), polled if plant else scripts_wait)
            ok = arrived and (threads > 0 if plant else threads == 0)
        assert agree(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("plant", [False, True])
def test_the_scripts_tests_of_a_message_start_no_thread_on_gloo(plant, tmp_path, monkeypatch):
    """The scripts Test their sends once an action to move MPICH on: on gloo those Tests answer "not
    yet" and start nothing (a waiting thread for each cost the pipeline a tenth of its step), and the
    step's Wait gets the message. The negative control: a waiter from the first Test on, the shim's
    former way, starts a thread."""
    monkeypatch.setattr(worker, "WAITERS", worker.Waiters())  # none idle yet: a waiter needed starts
    if plant:
        monkeypatch.setattr(worker, "TESTS_BEFORE_A_WAITER", 1)
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            threads, arrived = poked_and_waited(shim(comm, tmp_path), 20)
            ok = arrived and (threads > 0 if plant else threads == 0)
        assert agree(ok)


@pytest.mark.mpi
@pytest.mark.parametrize("plant", [False, True])
def test_the_waiting_threads_are_kept_for_the_next_work(plant, tmp_path, monkeypatch):
    """Polled past TESTS_BEFORE_A_WAITER, a work goes to a waiter; one after the other, 20 messages
    each way take 2 threads (a send and a receive at a time), not one a work: starting a thread waits
    for a core. The negative control: waiters never counted idle again start one a work."""
    monkeypatch.setattr(worker, "TESTS_BEFORE_A_WAITER", 1)
    monkeypatch.setattr(worker, "WAITERS", worker.Waiters())
    if plant:
        def serve_once(self):
            request = self.works.get()
            request.wait_on_thread()
            request.done.set()
        monkeypatch.setattr(worker.Waiters, "serve", serve_once)
    with sub_comm(2) as comm:
        ok, threads = True, 0
        if comm is not None:
            gloo = shim(comm, tmp_path)
            for _ in range(20):
                started, arrived = poked_and_waited(gloo, 1)
                threads += started if arrived else 1000
            ok = threads >= 40 if plant else threads <= 2
        assert agree(ok), threads


def run_data_parallel(comm, *flags):
    """data_parallel.py's main() in this process on comm: its exit code and --json object (rank 0's)."""
    import data_parallel
    out = io.StringIO()
    argv = ["--steps", "3", "--batch-size", "16", "--bucket-mb", "0.05", "--log-every", "1000000", "--json", *flags]
    with contextlib.redirect_stdout(out):
        code = data_parallel.main(argv, comm)
    lines = out.getvalue().strip().splitlines()
    return code, json.loads(lines[-1]) if comm.Get_rank() == 0 and lines else None


@pytest.mark.mpi
@pytest.mark.parametrize("plant", [False, True])
def test_data_parallel_passes_its_check_on_gloo_with_mpis_losses_bit_for_bit(plant, tmp_path, monkeypatch):
    """data_parallel.py --bucket-mb 0.05 (two buckets: Iallreduce, polled during backward) at N = 2 on
    the shim: its --check passes and its losses are MPI's run's, bit for bit. The negative control: a
    shim whose sums take the largest instead fails the check."""
    if plant:
        monkeypatch.setattr(worker, "gloo_op", lambda op: worker.dist.ReduceOp.MAX)
    with sub_comm(2) as comm:
        ok = True
        if comm is not None:
            code, on_gloo = run_data_parallel(shim(comm, tmp_path), "--check")
            if plant:
                ok = code == 1
            else:
                _, on_mpi = run_data_parallel(comm, "--no-check")
                ok = code == 0 and (comm.Get_rank() != 0 or on_gloo["losses"] == on_mpi["losses"])
        assert agree(ok)


# -----------------------------------------------------------------------------
# The verdict rule: at least 8 rounds, the median more than 3% from 1x, and a sign test's p below 0.05
# -----------------------------------------------------------------------------
@pytest.mark.parametrize("each,word", [
    ([0.8] * 5, "too few rounds"),  # 5 of 5 faster: p = 2 / 2^5 = 0.0625, and fewer than 8 rounds
    ([0.8] * 8, "faster"),  # 8 of 8: p = 2 / 2^8 = 0.0078
    ([1.2] * 8, "slower"),
    ([0.8] * 7 + [1.1], "tie"),  # 7 of 8: p = 2 * 9 / 256 = 0.070
    ([0.8] * 9 + [1.1], "faster"),  # 9 of 10: p = 2 * 11 / 1024 = 0.021
    ([0.98] * 10, "tie"),  # every round agrees, but within 3% of 1x
    ([0.9, 1.1] * 5, "tie"),  # the median is 1.0
])
def test_the_verdict_needs_eight_rounds_a_median_past_three_percent_and_a_sign_test(each, word):
    assert report.verdict(each)[0] == word


def test_the_sign_test_is_two_sided_and_leaves_out_rounds_of_exactly_one():
    assert report.sign_test(5, 5) == pytest.approx(0.0625)
    assert report.sign_test(8, 8) == pytest.approx(2 / 256)
    assert report.sign_test(0, 8) == pytest.approx(2 / 256)
    assert report.sign_test(4, 8) == 1.0
    assert report.verdict([0.8] * 8 + [1.0] * 2)[0] == "faster"  # 8 of the 8 that differ


def made_up(label, tags, seconds, peak_mib=None, **result):
    """A case as bench/worker.py records it: the median step, the step of every round, the peaks."""
    peaks = {"peak_memory_bytes_per_rank": [int(p * 2 ** 20) for p in peak_mib]} if peak_mib else {}
    return {"label": label, "tags": tags, "result": {"step_time_s": sorted(seconds)[len(seconds) // 2],
                                                     "step_time_s_rounds": seconds, **peaks, **result}}


def test_the_summary_pairs_ours_on_gloo_with_the_peer_beside_ours_on_mpi_with_both_peaks():
    """Ours on gloo at 0.95x in 7 of 8 rounds is a tie (p = 0.070), ours on MPI at 0.5x in 8 of 8 a
    win; the pipeline's fastest schedules meet, each side's chosen by its median."""
    dp = {"group": "dp", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 8, "rounds": 8, "mpi_library": "MPICH", "config": {"batch_size": 64}, "cases": [
            made_up("data_parallel.py", {"kind": "strategy", "variant": "default"}, [0.010] * 8, [2, 3], buckets=1,
                    comm_s=0.002),
            made_up("PyTorch DDP (gloo)", {"kind": "peer", "variant": "ddp"}, [0.020] * 8, [4, 4], buckets=1),
            made_up("data_parallel.py on gloo", {"kind": "on_gloo", "of": "data_parallel.py"},
                    [0.019] * 7 + [0.021], [2.5, 3.5]),
            made_up("no exchange (compute alone)", {"kind": "floor"}, [0.008] * 8),
            made_up("bare MPI Allreduce of the gradients", {"kind": "limit", "variant": "mpi"}, [0.0005],
                    bytes=247960)]}}

    def pp(kind, schedule, seconds, **tags):
        label = (f"pipeline_parallel.py --schedule {schedule} --micro-batches 4" if kind == "strategy"
                 else f"torch.distributed.pipelining {schedule}, M = 4")
        return made_up(label, {"kind": kind, "schedule": tags.pop("same", schedule), "m": 4, **tags}, seconds,
                       [1, 1], bubble_fraction=0.2, bubble_fraction_theory=0.2)
    ours = [pp("strategy", "1f1b", [0.10] * 8, strategy="pipeline_parallel"),
            pp("strategy", "zbv", [0.08] * 8, strategy="pipeline_parallel")]
    twins = [made_up(c["label"] + " on gloo", {"kind": "on_gloo", "of": c["label"]}, seconds, [1, 1])
             for c, seconds in zip(ours, ([0.11] * 8, [0.12] * 8))]
    peers = [pp("peer", "Schedule1F1B", [0.09] * 8, same="1f1b", torch="Schedule1F1B", placement="1f1b"),
             pp("peer", "ScheduleGPipe", [0.085] * 8, same="gpipe", torch="ScheduleGPipe", placement="gpipe")]
    pipeline = {"group": "pp", "ranks": 2, "env": {}, "error": None, "load": [1.0, 1.0], "result": {
        "steps": 5, "rounds": 8, "config": {"layers": 8}, "cases": ours + twins + peers}}
    meta = {"mode": "full", "command": "python bench/run.py", "date": "today", "torch": "2", "seconds": 1.0,
            "missing": [], "machine": {"cpu": "a CPU", "cores": 2, "load": 1.0, "python": "3"}}
    text = report.render(meta, [dp, pipeline])
    assert ("| data | 2 | data_parallel.py / PyTorch DDP (gloo) | 0.95× (0.95–1.05; faster in 7 of 8, p = 0.070) "
            "| tie | 2.5, 3.5 | 4.0, 4.0 | 0.50× (0.50–0.50; faster in 8 of 8, p = 0.008) | ours faster |") in text
    # 0.11 / 0.085 = 1.29 on gloo (1f1b, ours fastest there); 0.08 / 0.085 = 0.94 on MPI (zbv)
    assert ("| pipeline | 2 | the fastest of ours (on MPI zbv, on gloo 1f1b), M = 4 / the fastest of torch's "
            "(ScheduleGPipe) | 1.29× (1.29–1.29; faster in 0 of 8, p = 0.008) | PyTorch's faster | 1.0, 1.0 "
            "| 1.0, 1.0 | 0.94× (0.94–0.94; faster in 8 of 8, p = 0.008) | ours faster |") in text
