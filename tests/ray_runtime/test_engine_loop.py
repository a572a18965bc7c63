"""The engine loop (ray_runtime/engine_loop.py) over a model-free core (EchoRanks): requests
from other threads, the long-polled outbox, duplicate ids, aborts that overtake their add,
and a loop that keeps serving after a failed step."""
import threading
import time

import pytest

from ray_runtime import engine_loop
from ray_runtime.config import EngineConfig
from ray_runtime.echo_ranks import EchoRanks
from ray_runtime.engine_core import EngineCore
from ray_runtime.engine_loop import EngineLoop
from ray_runtime.messages import RequestSpec
from ray_runtime.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture
def loop(tiny_model):
    cfg = EngineConfig(model=tiny_model("llama"), max_num_seqs=8, max_num_batched_tokens=64,
                       num_kv_blocks=64, disable_log_stats=True)
    core = EngineCore(cfg, EchoRanks(), num_kv_blocks=64, max_model_len=256, eos_token_ids=[2])
    lp = EngineLoop(core)
    yield lp
    lp.stop()


def _spec(rid, n=5, kind=RequestOutputKind.FINAL_ONLY):
    return RequestSpec(rid, [3, 4, 5, 6], SamplingParams(max_tokens=n, temperature=0.0,
                                                         ignore_eos=True, output_kind=kind))


def _until_finished(lp, ids, timeout_s=20.0):
    done, deltas = {}, []
    deadline = time.monotonic() + timeout_s
    while set(ids) - set(done):
        assert time.monotonic() < deadline, f"not finished: {set(ids) - set(done)}"
        lp.ack, out = lp.get_outputs(getattr(lp, "ack", 0), 0.2)
        for d in out:
            deltas.append(d)
            if d.finished:
                done[d.req_id] = d
    return done, deltas


def test_requests_from_many_threads_all_finish_once(loop):
    ids = [f"t{t}-{i}" for t in range(4) for i in range(10)]
    threads = [threading.Thread(target=loop.add_requests,
                                args=([_spec(f"t{t}-{i}", n=1 + i % 4) for i in range(10)],))
               for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done, deltas = _until_finished(loop, ids)
    assert sorted(d.req_id for d in deltas if d.finished) == sorted(ids)  # each once
    for rid, d in done.items():
        assert d.finish_reason == "length" and len(d.new_token_ids) == 1 + int(rid.split("-")[1]) % 4


def test_streamed_deltas_add_up(loop):
    loop.add_requests([_spec("s", n=6, kind=RequestOutputKind.DELTA)])
    _, deltas = _until_finished(loop, ["s"])
    assert sum(len(d.new_token_ids) for d in deltas) == 6 and len(deltas) >= 2


def test_a_running_id_is_refused_in_the_caller(loop):
    loop.add_requests([_spec("d", n=200)])
    with pytest.raises(ValueError, match="'d' is already in use"):
        loop.add_requests([_spec("d")])
    with pytest.raises(ValueError, match="already in use"):
        loop.add_requests([_spec("e"), _spec("e")])
    loop.abort(["d"])
    done, _ = _until_finished(loop, ["d"])
    assert done["d"].finish_reason == "abort"


def test_an_abort_that_overtakes_its_add_still_aborts(loop, monkeypatch):
    loop.abort(["early"])
    loop.add_requests([_spec("early", n=500)])
    done, _ = _until_finished(loop, ["early"])
    assert done["early"].finish_reason == "abort"
    # an id reused later is a new request: a stale early abort does not touch it
    monkeypatch.setattr(engine_loop, "_EARLY_ABORT_S", 0.0)
    loop.abort(["reused"])
    loop.add_requests([_spec("reused", n=3)])
    done, _ = _until_finished(loop, ["reused"])
    assert done["reused"].finish_reason == "length"


def test_a_failed_step_fails_its_requests_and_the_loop_serves_on(loop, monkeypatch):
    core = loop.core
    real = core.ranks.read_replies
    calls = {"n": 0}

    def flaky(step_id):  # a rank answered this step with an error (its replies were read)
        replies = real(step_id)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return replies

    monkeypatch.setattr(core.ranks, "read_replies", flaky)
    loop.add_requests([_spec("f", n=20)])
    done, _ = _until_finished(loop, ["f"])
    assert done["f"].error is not None and "injected" in done["f"].error
    loop.add_requests([_spec("g", n=4)])
    done, _ = _until_finished(loop, ["g"])
    assert done["g"].finish_reason == "length" and done["g"].error is None
    assert loop.health()["healthy"]


def test_a_lost_poll_loses_nothing(loop):
    """A poll whose answer never reached its caller (cancelled mid-call): the next poll,
    acknowledging the same batch, gets the same deltas again; acknowledged ones are gone."""
    loop.add_requests([_spec("p", n=5, kind=RequestOutputKind.DELTA)])
    deadline = time.monotonic() + 20
    lost_seq, lost = 0, []
    while not lost:
        assert time.monotonic() < deadline
        lost_seq, lost = loop.get_outputs(0, 0.2)  # answered, but "never arrives"
    seq, again = loop.get_outputs(0, 0.2)  # still acknowledging batch 0
    assert again[:len(lost)] == lost and seq >= lost_seq
    loop.ack = seq
    deltas = [] if any(d.finished for d in again) else _until_finished(loop, ["p"])[1]
    assert sum(len(d.new_token_ids) for d in again + deltas) == 5
    assert loop.get_outputs(seq, 0.05) == (seq, [])  # acknowledged: gone


def test_a_late_abort_of_a_finished_id_does_not_touch_its_reuse(loop):
    loop.add_requests([_spec("late", n=2)])
    _until_finished(loop, ["late"])
    loop.abort(["late"])  # after it finished: late, not early
    loop.add_requests([_spec("late", n=3)])
    done, _ = _until_finished(loop, ["late"])
    assert done["late"].finish_reason == "length"


def test_health_is_true_after_a_long_idle_spell(loop):
    loop.core.last_progress -= 10 * loop.core.config.step_timeout_s  # idle for ages
    loop.add_requests([_spec("h", n=50)])
    time.sleep(0.05)
    assert loop.health()["healthy"]
    _until_finished(loop, ["h"])


def test_a_rank_failing_every_step_counts_as_lost_and_is_replaced(tiny_model):
    """A rank that reports an error at every step (a sticky device error) is replaced after
    MAX_FAILED_STEPS in a row, as a lost one is; the request then finishes."""
    from ray_runtime.engine_core import MAX_FAILED_STEPS

    cfg = EngineConfig(model=tiny_model("llama"), max_num_seqs=8, max_num_batched_tokens=64,
                       num_kv_blocks=64, disable_log_stats=True)
    replaced = []

    def replace(error):
        replaced.append(str(error))
        return EchoRanks()

    core = EngineCore(cfg, EchoRanks(), num_kv_blocks=64, max_model_len=256, eos_token_ids=[2],
                      replace_ranks=replace)
    broken = core.ranks
    real = broken.read_replies

    def always_failing(step_id):
        real(step_id)
        raise RuntimeError("sticky device error")

    broken.read_replies = always_failing
    lp = EngineLoop(core)
    try:
        for k in range(MAX_FAILED_STEPS - 1):
            lp.add_requests([_spec(f"x{k}", n=4)])
            done, _ = _until_finished(lp, [f"x{k}"])
            assert "sticky device error" in done[f"x{k}"].error and not replaced
        lp.add_requests([_spec("y", n=4)])
        done, _ = _until_finished(lp, ["y"])
        assert replaced and done["y"].error is None and done["y"].finish_reason == "length"
        assert len(done["y"].new_token_ids) == 4 and core.num_stage_restarts == 1
    finally:
        lp.stop()
