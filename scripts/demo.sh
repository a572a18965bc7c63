#!/usr/bin/env bash
# Install what the demo needs, convert SmolLM2-135M-Instruct once (cached), and run it with
# PP=2 on a local Ray cluster (or the running one), printing answers and tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh demo
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python3 -m ray_runtime demo --pipeline-parallel-size "${PP:-2}" "$@"
