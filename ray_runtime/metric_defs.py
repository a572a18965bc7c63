"""The engine's metric catalog: every metric's name, kind, description, labels and buckets
(vLLM V1's names under the prefix `ray_pp:`, plus per-stage series), and the label sets each
one exists with from engine start. `ray_runtime/metrics.py` records them; docs/operations.md
lists them; the Grafana dashboard and the tests read them from here."""
from __future__ import annotations

from dataclasses import dataclass

PREFIX = "ray_pp:"
BASE_TAGS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")  # request_success's finished_reason values

# Buckets: vLLM V1's, with a few smaller ones first (a GPU decode step here is ~1.5 ms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                           7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1) + REQUEST_LATENCY_BUCKETS[3:]
ITERATION_TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(15))  # 1 .. 16384
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0)


@dataclass(frozen=True)
class MetricDef:
    name: str  # without the prefix
    kind: str  # "counter", "gauge" or "histogram"
    description: str
    tags: tuple[str, ...] = ()  # beyond model_name and engine
    buckets: tuple[float, ...] = ()

    @property
    def full_name(self) -> str:
        """vLLM-style: `ray_pp:<name>` (the key of snapshot(), and the docs' name)."""
        return PREFIX + self.name

    @property
    def ray_name(self) -> str:
        """What ray.util.metrics registers: no ':' (Ray drops such names on export)."""
        return self.full_name.replace(":", "_")

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return BASE_TAGS + self.tags


METRICS: tuple[MetricDef, ...] = (
    MetricDef("num_requests_running", "gauge", "Requests in the running batch (scheduled on the ranks)."),
    MetricDef("num_requests_waiting", "gauge", "Requests waiting to be admitted (new or preempted)."),
    MetricDef("kv_cache_usage_perc", "gauge", "KV-cache usage: fraction of the KV blocks in use (1 = full)."),
    MetricDef("prompt_tokens", "counter", "Prompt tokens of the requests received."),
    MetricDef("generation_tokens", "counter", "Output tokens committed."),
    MetricDef("request_success", "counter", "Requests finished, by finish reason (stop, length, abort).",
              ("finished_reason",)),
    MetricDef("num_preemptions", "counter", "Preemptions (a request's KV dropped, recomputed later)."),
    MetricDef("spec_decode_num_drafts", "counter", "Speculative decoding: steps that verified drafts, per request."),
    MetricDef("spec_decode_num_draft_tokens", "counter", "Speculative decoding: draft tokens verified."),
    MetricDef("spec_decode_num_accepted_tokens", "counter", "Speculative decoding: draft tokens accepted."),
    MetricDef("bookkeeping_mismatches", "counter",
              "Rows of a rank whose digest disagreed with the driver's view (repaired or raised).",
              ("pp_rank",)),
    MetricDef("time_to_first_token_seconds", "histogram",
              "Time from a request's arrival to its first output token.", buckets=TTFT_BUCKETS),
    MetricDef("inter_token_latency_seconds", "histogram",
              "Per request with 2+ output tokens: its mean time between output tokens.",
              buckets=ITL_BUCKETS),
    MetricDef("e2e_request_latency_seconds", "histogram",
              "Time from a request's arrival to its last token.", buckets=REQUEST_LATENCY_BUCKETS),
    MetricDef("request_queue_time_seconds", "histogram",
              "Time from a request's arrival to its first scheduling.", buckets=QUEUE_BUCKETS),
    MetricDef("iteration_tokens_total", "histogram", "Tokens scheduled per engine step.",
              buckets=ITERATION_TOKEN_BUCKETS),
    MetricDef("stage_step_seconds", "histogram",
              "A stage's busy time per step (activations in to activations/result out).",
              ("pp_rank",), STEP_BUCKETS),
    MetricDef("stage_busy_seconds", "counter", "A stage's busy time (sum of its step times).",
              ("pp_rank",)),
    MetricDef("stage_idle_seconds", "counter",
              "A stage's idle time during generate calls: between steps and waiting for activations.",
              ("pp_rank",)),
    MetricDef("stage_idle_fraction", "gauge",
              "A stage's idle / (busy + idle) over the last flush interval.", ("pp_rank",)),
    MetricDef("stage_recv_wait_seconds", "counter",
              "A stage's time from picking a plan up to having the step's input: applying the "
              "plan, staging inputs and, on ranks > 0, waiting for the previous stage's activations.",
              ("pp_rank",)),
    MetricDef("stage_send_seconds", "counter",
              "A stage's time handing activations on (or encoding its result) after compute.",
              ("pp_rank",)),
    MetricDef("stage_digest_seconds", "counter",
              "A stage's time fingerprinting rows for the bookkeeping audit.", ("pp_rank",)),
    MetricDef("stage_gpu_busy_seconds", "counter",
              "CUDA: a stage's device time for its steps (CUDA events).", ("pp_rank",)),
)
BY_NAME = {m.name: m for m in METRICS}

# The engine's own cumulative totals that become counters (flush() records their growth).
TOTAL_COUNTERS = ("prompt_tokens", "generation_tokens", "num_preemptions", "spec_decode_num_drafts",
                  "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
STAGE_TOTALS = {"stage_busy_s": "stage_busy_seconds", "stage_idle_s": "stage_idle_seconds",
                "stage_digest_s": "stage_digest_seconds", "stage_gpu_busy_s": "stage_gpu_busy_seconds",
                "bookkeeping_mismatches": "bookkeeping_mismatches"}


def label_sets(defn: MetricDef, pp_size: int) -> list[tuple]:
    """Every label tuple (in `defn.tags` order) a metric can be recorded with: () for an
    untagged one, each pp_rank 0..pp_size-1, each finish reason. The series that exist from
    engine start."""
    values = {"pp_rank": tuple(range(pp_size)), "finished_reason": FINISH_REASONS}
    sets: list[tuple] = [()]
    for tag in defn.tags:
        sets = [labels + (v,) for labels in sets for v in values[tag]]
    return sets
