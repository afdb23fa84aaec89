"""What one allreduce costs when MPI cannot read GPU memory, measured part by part.

Every strategy file hands MPI host memory when the library is not CUDA-aware (and for every
non-blocking collective): it waits for the GPU's queued work, copies the tensor to pinned host
memory, lets MPI reduce it on the CPUs, and copies the result back. This script times those parts
for a few message sizes, beside the same allreduce on host memory alone:

    mpirun -np 2 python bench/staged_cost.py                # on a GPU node: one rank per GPU
    mpirun -np 2 python bench/staged_cost.py --device cpu   # the host part alone

Bandwidths are bus bandwidths as nccl-tests reports them for an allreduce (bytes x 2(N-1)/N over
the time), so that a row can stand beside a published NCCL figure for the same GPUs. The medians
of --repeats timed calls after two untimed ones, the slowest rank's."""
import argparse
import os
import statistics
import time

import mpi4py

mpi4py.rc.initialize = False  # the GPU is chosen before MPI starts, as in the strategy files
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402


def timed(comm, repeats, call):
    """The slowest rank's median of `repeats` calls of call(), after two untimed ones."""
    times = []
    for i in range(repeats + 2):
        comm.Barrier()
        start = time.perf_counter()
        call()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def measure(comm, device, size_mb, repeats):
    """{part: seconds} of one float32 allreduce of size_mb megabytes."""
    n = int(size_mb * 2**20) // 4
    host = torch.ones(n)
    parts = {"host allreduce": timed(comm, repeats, lambda: comm.Allreduce(MPI.IN_PLACE, host))}
    if device.type == "cuda":
        gpu, pinned = torch.ones(n, device=device), torch.empty(n, pin_memory=True)

        def staged():
            pinned.copy_(gpu)  # waits for the GPU's queued work, then the copy over PCIe
            comm.Allreduce(MPI.IN_PLACE, pinned)
            gpu.copy_(pinned, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        parts["device to host"] = timed(comm, repeats, lambda: pinned.copy_(gpu))
        parts["host to device"] = timed(comm, repeats, lambda: (gpu.copy_(pinned, non_blocking=True),
                                                                torch.cuda.current_stream().synchronize()))
        parts["staged allreduce"] = timed(comm, repeats, staged)
    return parts


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 4, 64], help="message sizes in MB")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per part and size")
    args = p.parse_args()
    launchers = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")  # the local rank
    local = int(next((os.environ[k] for k in launchers if k in os.environ), 0))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    MPI.Init_thread(MPI.THREAD_SERIALIZED)
    comm = MPI.COMM_WORLD
    N = comm.Get_size()
    torch.set_num_threads(1)
    rows = [(size, measure(comm, device, size, args.repeats)) for size in args.sizes_mb]
    if comm.Get_rank() == 0:
        name = torch.cuda.get_device_name(device) if cuda else "no GPU"
        print(f"{N} ranks, {name}, {MPI.Get_library_version().splitlines()[0].strip()}")
        print("| MB | part | ms | bus GB/s |\n|---|---|---|---|")
        for size, parts in rows:
            for part, seconds in parts.items():
                factor = 2 * (N - 1) / N if "allreduce" in part else 1  # a copy moves its bytes once
                print(f"| {size:g} | {part} | {seconds * 1e3:.4g} | {size * 2**20 * factor / seconds / 1e9:.3g} |")
    MPI.Finalize()


if __name__ == "__main__":
    main()
