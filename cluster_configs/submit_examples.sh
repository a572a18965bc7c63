#!/usr/bin/env bash
# `ray job submit` examples for ray-pp-runtime. Run from the repository root:
#
#   bash cluster_configs/submit_examples.sh            # list the examples
#   bash cluster_configs/submit_examples.sh local      # run one of them
#
# or copy a command out of a function below. Override the defaults with environment
# variables, e.g.  MODEL=/models/llama PP=4 bash cluster_configs/submit_examples.sh remote
#
# The job's entrypoint is the project's CLI:
#   python -m ray_runtime generate --model DIR --pipeline-parallel-size P
#       --input prompts.jsonl --output out.jsonl
#       [--max-tokens N --temperature T --top-p P --top-k K --seed S --ignore-eos]
#       [--device cuda|cpu --dtype bfloat16|float16|float32 --placement-strategy PACK|SPREAD]
#
# Resources: the job reserves one placement-group bundle per pipeline stage, 1 GPU per
# bundle with --device cuda and 1 CPU per bundle with --device cpu. If the cluster cannot
# hold P such bundles the placement group is never ready and no stage starts.
# `ray status` shows the CPUs and GPUs each node offers and what is already in use; run it
# on a cluster node, or `ray exec cluster_configs/ray-cluster-launcher.yaml "ray status"`.
#
# Placement: bundles are PACKed by default (as few nodes as possible, so a multi-GPU node
# keeps activations on its own links); --placement-strategy SPREAD puts each stage on a
# different node where it can.
#
# Paths: --working-dir . uploads this checkout and makes it the job's current directory on
# every node, so a relative --input (a file in the checkout) is found. Write --output to an
# absolute path: a relative one lands in the uploaded copy, which Ray deletes later. The
# entrypoint runs on the head node, so that is where the output file appears. --model must
# exist at the same path on every node that hosts a stage.
#
# Auth: the clusters of cluster_configs/ run with Ray's token auth (RAY_AUTH_MODE=token), and
# so does a local `ray start` once ~/.ray/auth_token exists. The client needs the same mode
# and the cluster's token: in ~/.ray/auth_token, or RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH
# (KubeRay: read it from the cluster's Secret, see kuberay-raycluster.yaml). Set
# RAY_AUTH_MODE=disabled to talk to a cluster started without auth.
set -euo pipefail

export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
MODEL="${MODEL:-/models/my-model}"
PP="${PP:-2}"
INPUT="${INPUT:-prompts.jsonl}"
OUTPUT="${OUTPUT:-/tmp/ray-pp-out.jsonl}"
RUNTIME_ENV="cluster_configs/runtime_env.yaml"

# A single machine: `ray start --head` (or a running `ray.init()` cluster) on this host
# serves the job API at http://127.0.0.1:8265.
local_gpu() {
  ray job submit --address http://127.0.0.1:8265 \
    --runtime-env "$RUNTIME_ENV" --working-dir . \
    -- python -m ray_runtime generate \
      --model "$MODEL" --pipeline-parallel-size "$PP" \
      --device cuda --dtype bfloat16 \
      --input "$INPUT" --output "$OUTPUT" \
      --max-tokens 256 --temperature 0.0
}

# Same on CPU only (1 CPU per stage), float32: slow, but deterministic and handy for
# checking a setup with a small model.
local_cpu() {
  ray job submit --address http://127.0.0.1:8265 \
    --runtime-env "$RUNTIME_ENV" --working-dir . \
    -- python -m ray_runtime generate \
      --model "$MODEL" --pipeline-parallel-size "$PP" \
      --device cpu --dtype float32 \
      --input "$INPUT" --output "$OUTPUT" \
      --max-tokens 32 --temperature 0.0
}

# A remote cluster. Reach its dashboard port (8265) first, for example
#   ray dashboard cluster_configs/ray-cluster-launcher.yaml          (launcher cluster)
#   kubectl port-forward svc/ray-pp-runtime-head-svc 8265:8265       (KubeRay)
# both of which make it http://127.0.0.1:8265 here; or export RAY_ADDRESS=http://HEAD_IP:8265
# if the head is directly reachable. Sampled generation with a fixed seed; --no-wait
# returns at once and prints the submission id.
remote() {
  ray job submit --address "$RAY_ADDRESS" --no-wait \
    --runtime-env "$RUNTIME_ENV" --working-dir . \
    -- python -m ray_runtime generate \
      --model "$MODEL" --pipeline-parallel-size "$PP" \
      --device cuda --dtype bfloat16 \
      --input "$INPUT" --output "$OUTPUT" \
      --max-tokens 512 --temperature 0.7 --top-p 0.9 --top-k 50 --seed 1234
}

# One stage per node (e.g. single-GPU nodes, or to test cross-node pipelining), with fixed
# output lengths for benchmarking: --ignore-eos makes every request produce --max-tokens.
remote_spread() {
  ray job submit --address "$RAY_ADDRESS" \
    --runtime-env "$RUNTIME_ENV" --working-dir . \
    -- python -m ray_runtime generate \
      --model "$MODEL" --pipeline-parallel-size "$PP" \
      --device cuda --dtype bfloat16 \
      --placement-strategy SPREAD \
      --input "$INPUT" --output "$OUTPUT" \
      --max-tokens 128 --ignore-eos
}

# Following a submitted job: ray job list / status / logs --follow / stop.
follow() {
  local submission_id="${1:?usage: follow SUBMISSION_ID}"
  ray job status --address "$RAY_ADDRESS" "$submission_id"
  ray job logs --address "$RAY_ADDRESS" --follow "$submission_id"
  # ray job stop --address "$RAY_ADDRESS" "$submission_id"
}

usage() {
  cat <<EOF
usage: bash cluster_configs/submit_examples.sh EXAMPLE [ARGS]
examples: local_gpu | local_cpu | remote | remote_spread | follow SUBMISSION_ID
defaults: RAY_ADDRESS=$RAY_ADDRESS MODEL=$MODEL PP=$PP INPUT=$INPUT OUTPUT=$OUTPUT RAY_AUTH_MODE=$RAY_AUTH_MODE
EOF
}

case "${1:-}" in
  local | local_gpu) local_gpu ;;
  local_cpu) local_cpu ;;
  remote) remote ;;
  remote_spread | spread) remote_spread ;;
  follow) shift; follow "$@" ;;
  *) usage ;;
esac
