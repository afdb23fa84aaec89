#!/usr/bin/env bash
# The first run on a GPU node: every strategy on the GPU with --check, both transports, the
# thread-level refusal, a SIGTERM to the ranks and a resume; one markdown table in bench/gpu-smoke.md,
# under 8 minutes. A launch out of time is ended whole: no rank stays on a GPU.
#   --launcher "srun --mpi=pmix"       where Slurm, not mpirun, starts the ranks (pmi2: as your MPI was built)
#   --launcher "mpirun --oversubscribe" Open MPI in an allocation of fewer than 8 slots (Open MPI 5:
#                                       "mpirun --map-by :OVERSUBSCRIBE")
# As root, Open MPI's mpirun wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_smoke.py "$@"
