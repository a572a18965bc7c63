"""The pipeline trace's idle accounting (ray_runtime/trace.py): a later rank's wait for
activations and gaps between steps are idle; rank 0's wait for the last rank's fed-back
tokens is idle too (a rank 0 that blocks on them must not look busy)."""
import statistics

import pytest

from ray_runtime.messages import StageTiming
from ray_runtime.trace import PipelineTrace


def test_waits_count_as_idle_on_every_rank():
    tr = PipelineTrace(2, record_events=True)
    # rank 0: step 0 busy 1.0 s; step 1 starts at once, waits 0.5 s for fed-back tokens
    tr.stage_step(0, 0, StageTiming(0.0, 0.0, 0.8, 1.0, 0.0))
    tr.stage_step(0, 1, StageTiming(1.0, 1.5, 2.3, 2.5, 0.0, token_wait_s=0.5))
    # rank 1: waits 1.0 s for step 0's activations, then a 0.5 s gap before step 1
    tr.stage_step(1, 0, StageTiming(0.0, 1.0, 1.8, 2.0, 0.0))
    tr.stage_step(1, 1, StageTiming(2.5, 2.5, 3.3, 3.5, 0.0))
    assert tr.idle_s == [0.5, 1.5]
    assert tr.busy_s == [2.0, 2.0]
    assert [round(f, 3) for f in tr.idle_fractions()] == [0.2, 0.429]
    # the host's launch: plan in to compute done, less rank 0's token wait
    assert [round(x, 3) for x in tr.launch_s] == [0.8 + 0.8, 1.8 + 0.8] and tr.steps == [2, 2]
    names = {(e["tid"], e["name"]) for e in tr.events}
    assert (1, "token wait") in names and (2, "recv wait") in names and (2, "idle") in names


def test_device_spans_get_a_track_per_stage():
    """With the phase clock on CUDA a reply carries its stage's completed device spans: they
    land on the stage's "gpu" track, on the hosts' time axis, and the latest phase totals
    are kept per rank."""
    from ray_runtime.trace import GPU_TID

    tr = PipelineTrace(2, record_events=True)
    tr.stage_step(1, 4, StageTiming(0.0, 0.0, 0.8, 1.0, 0.0, phases={"launch": (1, 0.8)},
                                    gpu_spans=[(3, 0.2, 0.9), (4, 1.0, 1.6)]))
    gpu = [e for e in tr.events if e["tid"] == GPU_TID + 1]
    assert [(e["args"]["step"], e["ts"], e["dur"]) for e in gpu] == \
        [(3, 0.2e6, 0.7e6), (4, 1.0e6, pytest.approx(0.6e6))]
    assert tr.phases == [None, {"launch": (1, 0.8)}]
    tracks = {e["args"]["name"] for e in tr.to_json()["traceEvents"] if e["ph"] == "M"}
    assert "stage 1 gpu" in tracks and "stage 0 gpu" not in tracks, "a track per stage with spans"


def test_pipeline_timeline_reads_hops_and_the_feedback_loop():
    """bench/pipeline_timeline.py on a synthetic PP=2 trace: two micro-batches, each stage's
    device busy 1.0 ms a step; stage 1 starts 0.25 ms after stage 0 ends (a hop), and rank 0
    runs a micro-batch's next step 0.5 ms after the last stage's device ends it."""
    from bench.pipeline_timeline import timeline

    tr = PipelineTrace(2, record_events=True)
    g0 = {0: 0.0, 1: 1.0}  # rank 0's device starts (ms)
    g1 = {}
    for s in range(2, 40):  # micro-batch s % 2: its step s follows its step s - 2
        g1[s - 2] = g0[s - 2] + 1.0 + 0.25
        g0[s] = max(g0[s - 1] + 1.0, g1[s - 2] + 1.0 + 0.5)
    for rank, g in ((0, g0), (1, g1)):
        for s, t in sorted(g.items()):
            t /= 1e3
            fed_from = s - 2 if rank == 0 and s >= 2 else -1  # the micro-batch's previous step
            tr.stage_step(rank, s, StageTiming(t - 2e-4, t - 1e-4, t, t + 1e-4, 0.0,
                                               fed_from_step=fed_from,
                                               gpu_spans=[(s, t, t + 1e-3)]))
    out = timeline(tr.to_json()["traceEvents"])
    assert out["pp"] == 2
    assert out["gpu_ms"] == [1.0, 1.0]
    assert out["hop_ms"] == [0.25]
    assert out["feedback_ms"] == 0.5
    assert out["host_lead_ms"] == [0.2, 0.2]
    # rank 0 alternates: it waits 0.75 ms for a micro-batch's fed tokens, then runs the
    # other micro-batch at once (2.75 ms a round of two 1 ms steps)
    lo, hi = out["window"]
    gaps = [round(g0[s] - g0[s - 1] - 1.0, 6) for s in range(lo, hi)]
    assert set(gaps) == {0.0, 0.75}
    assert out["gap_before_ms"][0] == pytest.approx(statistics.median(gaps), abs=1e-3)
    # and so over the window each device is busy 2 ms of every 2.75
    assert out["window_idle_fraction"] == [pytest.approx(0.75 / 2.75, abs=0.02)] * 2
    # every step of rank 0 in the window waited for its micro-batch's previous step's samples
    assert out["fed_from_lag"] == {2: len([s for s in g0 if lo <= s < hi])}


def test_pipeline_timeline_splits_the_last_call_by_the_kind_of_step():
    """last_call: two earlier calls (the pause before the second is the longest), then the
    last: two prefill steps (4 ms on stage 0, 2 on stage 1) and two decode steps (1 ms on
    each; the second verifies drafts: all its tokens get logits, none is a prompt's). Stage
    1 waits for stage 0 (fill 4 ms, then 2 ms before the second prefill step), stage 0 drains
    2 ms at the end. Wall 12 ms."""
    from bench.pipeline_timeline import timeline

    tr = PipelineTrace(2, record_events=True)
    ms = 1e-3
    earlier = {0: {0: (-300, -299), 1: (-100, -99)}, 1: {0: (-299, -298), 1: (-99, -98)}}
    call = {0: {2: (0, 4), 3: (4, 8), 4: (8, 9), 5: (9, 10)},
            1: {2: (4, 6), 3: (8, 10), 4: (10, 11), 5: (11, 12)}}
    plan_at = {0: -300.5, 1: -100.5, 2: -0.9, 3: -0.8, 4: -0.7, 5: -0.6}
    tokens = {0: (100, 100), 1: (100, 100), 2: (100, 98), 3: (100, 98), 4: (2, 0), 5: (6, 0)}
    for s, t in plan_at.items():
        if s in (0, 1, 2):  # the engine takes up each call's requests after idling
            tr.reset_window((t - 0.05) * ms)
        tr.driver_span("plan", t * ms, (t + 0.01) * ms, step=s, reqs=2, tokens=tokens[s][0],
                       prompt_tokens=tokens[s][1])
    for spans in (earlier, call):
        for rank in (0, 1):
            for s, (a, b) in spans[rank].items():
                tr.stage_step(rank, s, StageTiming(a * ms - 2e-4, a * ms - 1e-4, a * ms,
                                                   a * ms + 1e-4, 0.0,
                                                   gpu_spans=[(s, a * ms, b * ms)]))
    got = timeline(tr.to_json()["traceEvents"])["last_call"]
    assert got["steps"] == 4 and got["prefill_steps"] == 2 and got["wall_ms"] == 12.0
    assert got["lead_ms"] == {"busy_to_plan": 0.05, "plan_to_device": 0.9}
    assert got["window_epoch_ms"] == [0.0, 12.0]
    r = lambda x: round(x / 12, 3)  # noqa: E731
    assert got["stage0"] == {"prefill_busy": r(8), "prefill_idle": 0.0, "decode_busy": r(2),
                             "decode_idle": 0.0, "fill": 0.0, "drain": r(2)}
    assert got["stage1"] == {"prefill_busy": r(4), "prefill_idle": r(2), "decode_busy": r(2),
                             "decode_idle": 0.0, "fill": r(4), "drain": 0.0}
    # a trace without the marks (or the prompt counts) has no last_call
    events = [e for e in tr.to_json()["traceEvents"] if e.get("name") != "busy"]
    assert timeline(events)["last_call"] is None


def test_pipeline_timeline_needs_device_spans():
    from bench.pipeline_timeline import timeline

    tr = PipelineTrace(1, record_events=True)
    tr.stage_step(0, 0, StageTiming(0.0, 0.0, 0.8, 1.0, 0.0))
    with pytest.raises(ValueError, match="RAY_RUNTIME_PHASE_CLOCK"):
        timeline(tr.to_json()["traceEvents"])
