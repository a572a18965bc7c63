#!/usr/bin/env bash
# Install what the tests need, then run them all. pytest's "no tests collected" (exit 5)
# counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test || exit 1
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
python3 -m pytest -q --durations=15 "$@" tests
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
