"""The control plane: a StepLoop behind a real socket, driven as the driver drives it. Plans
are answered once each, in order; a step that raises is answered with its error and the loop
goes on; a stage still running its device work answers later without reordering; a dead
peer and a silent one are clear errors naming the stage."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ray_runtime.channel import ERROR, PLAN, RESULT, STOP, Channel, ChannelClosed
from ray_runtime.messages import (CachedRequestData, RowDigests, StageStepResult, StageTiming,
                                  StepPlan, decode_result, encode)
from stages.step_loop import StepLoop


class FakeRunner:
    """Answers each plan with its step id; `slow` steps report 'not done' for a while (the
    device still running); `fail_at` raises in launch."""

    rank = 3
    device = "cpu"

    def __init__(self, fail_at: int = -1, slow: frozenset = frozenset(),
                 inflight_steps: int = 2) -> None:
        self.config = SimpleNamespace(inflight_steps=inflight_steps)  # the step loop's limit
        self.fail_at, self.slow = fail_at, slow
        self.launch_order: list[int] = []
        self.events: list[tuple[str, int]] = []

    def launch(self, plan: StepPlan):
        if plan.step_id == self.fail_at:
            raise ValueError(f"planted failure at step {plan.step_id}")
        self.launch_order.append(plan.step_id)
        self.events.append(("launch", plan.step_id))
        return (plan.step_id, time.monotonic() + (0.05 if plan.step_id in self.slow else 0.0))

    def step_done(self, step) -> bool:
        return time.monotonic() >= step[1]

    def finish(self, step) -> StageStepResult:
        while not self.step_done(step):
            time.sleep(0.001)
        self.events.append(("finish", step[0]))
        t = StageTiming(0.0, 0.0, 0.0, 0.0, 0.0)
        return StageStepResult(step_id=step[0], rank=self.rank, timing=t, digests=RowDigests())


def _plan(step: int) -> bytes:
    return encode(StepPlan(step, [], [], CachedRequestData(), [], []))


def _connect(runner) -> tuple[StepLoop, Channel]:
    loop = StepLoop(runner, "127.0.0.1")
    return loop, Channel.connect(*loop.address, peer="stage rank 3")


def test_plans_are_answered_once_each_in_order():
    runner = FakeRunner(slow=frozenset(range(0, 40, 3)))
    loop, chan = _connect(runner)
    for step in range(40):  # two in flight, as the driver keeps them
        chan.send(PLAN, _plan(step))
        if step >= 1:
            kind, payload = chan.recv(timeout_s=5)
            assert kind == RESULT and decode_result(payload).step_id == step - 1
    kind, payload = chan.recv(timeout_s=5)
    assert decode_result(payload).step_id == 39
    assert runner.launch_order == list(range(40))
    # a slow step's successor (already waiting) was launched before the slow one finished:
    # the overlap; a step that is done at once is never held back
    ev = runner.events
    for s in range(0, 39, 3):
        assert ev.index(("launch", s + 1)) < ev.index(("finish", s)), f"step {s}: no overlap"
    for s in range(1, 39, 3):
        assert ev.index(("finish", s)) < ev.index(("launch", s + 1)), f"step {s} held back"
    chan.send(STOP)
    assert loop.join(5), "the loop did not stop on STOP"
    chan.close()


def test_several_steps_in_flight_launch_before_the_oldest_is_answered():
    """With 4 steps in flight (2 x PP at PP=2 with token feedback) every plan that arrives
    is launched while the older ones still run, and the replies come in step order; a fifth
    plan waits for the oldest step."""
    runner = FakeRunner(slow=frozenset(range(8)), inflight_steps=4)
    runner.step_done = lambda step: time.monotonic() >= step[1] + 0.2  # each runs 0.2 s
    loop, chan = _connect(runner)
    for step in range(5):
        chan.send(PLAN, _plan(step))
    time.sleep(0.1)
    assert runner.launch_order == [0, 1, 2, 3], runner.launch_order  # the 5th waits
    assert not [e for e in runner.events if e[0] == "finish"]
    got = [decode_result(chan.recv(timeout_s=5)[1]).step_id for _ in range(5)]
    assert got == [0, 1, 2, 3, 4] and runner.launch_order == [0, 1, 2, 3, 4]
    assert runner.events.index(("finish", 0)) < runner.events.index(("launch", 4))
    chan.send(STOP)
    assert loop.join(5)
    chan.close()


def test_a_failing_step_is_answered_with_its_error_and_the_loop_goes_on():
    loop, chan = _connect(FakeRunner(fail_at=2))
    replies = []
    for step in range(5):
        chan.send(PLAN, _plan(step))
        replies.append(chan.recv(timeout_s=5))
    assert [k for k, _ in replies] == [RESULT, RESULT, ERROR, RESULT, RESULT]
    err = replies[2][1].decode()
    assert "stage rank 3 failed" in err and "planted failure at step 2" in err
    assert decode_result(replies[3][1]).step_id == 3
    chan.send(STOP)
    assert loop.join(5)
    chan.close()


def test_a_dead_stage_is_a_clear_error():
    loop, chan = _connect(FakeRunner())
    chan.send(PLAN, _plan(0))
    chan.recv(timeout_s=5)
    chan.send(STOP)  # the stage's loop ends and closes its end, as a dying process would
    assert loop.join(5)
    with pytest.raises(ChannelClosed, match="stage rank 3: the peer closed the channel"):
        chan.recv(timeout_s=5)
    chan.close()


def test_a_silent_stage_times_out_naming_it():
    runner = FakeRunner(slow=frozenset({0}))
    runner.step_done = lambda step: False  # the device never finishes

    loop, chan = _connect(runner)
    chan.send(PLAN, _plan(0))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stage rank 3: no reply within 0.3s"):
        chan.recv(timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    chan.close()


def test_profiler_window_covers_the_asked_plans(tmp_path, monkeypatch):
    """RAY_RUNTIME_TORCH_PROFILER_DIR / _PROFILE_STEPS: the stage writes a torch.profiler
    trace of plans [2, 5) with the step loop's phases in it, and only once."""
    import json

    from stages import profiling

    monkeypatch.setenv(profiling.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(profiling.STEPS_ENV, "2:5")
    runner = FakeRunner()
    loop, chan = _connect(runner)
    for step in range(8):
        chan.send(PLAN, _plan(step))
        assert decode_result(chan.recv(timeout_s=5)[1]).step_id == step
        if step == 3:
            assert profiling._active, "the window is open at plan 3"
    assert not profiling._active, "the window closed after the reply to plan 4"
    chan.send(STOP)
    assert loop.join(5)
    chan.close()
    written = list(tmp_path.glob("stage3_pid*.json"))
    assert len(written) == 1, written
    trace = json.loads(written[0].read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    assert names.count("launch") == 3 and names.count("reply") == 3, names


def test_profiler_steps_are_checked(monkeypatch):
    from stages import profiling

    monkeypatch.setenv(profiling.DIR_ENV, "/tmp/x")
    for bad in ("5", "5:2", "a:b"):
        monkeypatch.setenv(profiling.STEPS_ENV, bad)
        with pytest.raises(ValueError, match="RAY_RUNTIME_PROFILE_STEPS"):
            profiling.StepProfiler.from_env(FakeRunner())


def test_sync_debug_mode_is_checked(monkeypatch):
    from stages import profiling

    monkeypatch.setenv(profiling.SYNC_DEBUG_ENV, "loud")
    with pytest.raises(ValueError, match="RAY_RUNTIME_SYNC_DEBUG: expected warn or error"):
        profiling.prepare("cpu")
    monkeypatch.setenv(profiling.SYNC_DEBUG_ENV, "error")
    assert profiling.sync_debug_mode() == "error"
    profiling.start_step_loop("cpu")  # CPU: nothing to set, nothing raised


def test_bad_profile_steps_fail_at_stage_start(monkeypatch):
    """A bad window is refused when the stage starts (naming the variable), not in the step
    loop's thread, where it would only show as a closed channel."""
    from stages import profiling

    monkeypatch.setenv(profiling.DIR_ENV, "/tmp/x")
    monkeypatch.setenv(profiling.STEPS_ENV, "9:3")
    with pytest.raises(ValueError, match="RAY_RUNTIME_PROFILE_STEPS"):
        profiling.prepare("cpu")
