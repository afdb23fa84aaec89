#!/usr/bin/env bash
# The first run on a GPU node: every strategy on the GPU with --check, both transports, the
# thread-level refusal, a SIGTERM and resume; one markdown table in bench/gpu-smoke.md, under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_smoke.py "$@"
